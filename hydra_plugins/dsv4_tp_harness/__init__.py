"""The harness's Hydra plugins, found by Hydra's plugin scan of the `hydra_plugins` namespace:
the default sweeper and launcher of `python -m launcher -m` (`harness_sweeper.py`)."""
