"""The run config: Hydra schemas, the resolvers of the sweep files, and the one reader that turns
a composed config into a validated RunSpec (`launcher.config.spec.run_spec`).

Importing this package registers the schemas and the resolvers with Hydra (`schema.register`),
so a config composed after any import of `launcher.config` finds them.
"""

from launcher.config.schema import register

register()
