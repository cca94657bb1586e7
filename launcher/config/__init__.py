"""The run config: Hydra schemas and the one reader that turns a composed config into a validated RunSpec."""
