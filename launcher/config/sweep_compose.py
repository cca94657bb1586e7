"""A sweep's job configs, composed by Hydra once per choice of config groups.

Hydra composes a job by building its defaults list (the config groups' choices), merging the
configs it names, and then applying each plain `key=value` override to the result
(`OmegaConf.update(cfg, key, value, merge=True)`), recording the overrides in
`hydra.overrides.task` and `hydra.job.override_dirname`. Two jobs whose overrides differ only in
such values (`tp=1` / `tp=8`, `seed=1,2,3`) therefore differ only in those leaves and those two
records: the second job's config is the first's, copied, with its own values set by Hydra's own
override step and its own records written as Hydra writes them. A composition is 0.1 to 0.2 s,
a copy a few milliseconds.

Only what is certainly a leaf value is set this way (`PlainValues`): a `key=value` override (no
`+`, `++`, `~` or `@package`) of a scalar, whose key is no config group (neither in the
repository nor among the first job's choices), is a leaf in the first job's config, and no
other override names a node above or below it. Any other job, and any job whose values Hydra's
override step refuses, is composed by Hydra in full (and so fails with Hydra's own error).

Torch-free: the harness's sweeper imports it in Hydra's plugin scan of every application.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence

from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from omegaconf import DictConfig, OmegaConf, ValueNode, open_dict

_DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_SCALARS = (str, int, float, bool, type(None))


class PlainValues:
    """Which of a job's overrides may be set on a copy of another job's config: the plain
    scalar values of keys that are no config group (`is_group`: the config repository's)."""

    def __init__(self, is_group: Callable[[str], bool]) -> None:
        self.is_group = is_group
        self.parser = OverridesParser.create()

    def parse(self, job: Sequence[str]) -> list[Override]:
        return self.parser.parse_overrides(list(job))

    def is_plain(self, o: Override) -> bool:
        key = o.key_or_group
        return (o.type == OverrideType.CHANGE and o.package is None and not o.is_sweep_override()
                and _DOTTED_KEY.fullmatch(key) is not None and key.split(".")[0] != "hydra"
                and isinstance(o.value(), _SCALARS) and not self.is_group(key))

    def signature(self, job: Sequence[Override]) -> tuple:
        """Equal for two jobs that differ at most in their plain values, key by key in order."""
        return tuple(("value", o.key_or_group) if self.is_plain(o) else ("override", o.input_line) for o in job)


def compose_jobs(jobs: Sequence[Sequence[str]], plain: PlainValues, master: DictConfig,
                 compose_first: Callable[[list[list[str]]], list[DictConfig | None]],
                 compose: Callable[[list[str]], DictConfig]) -> list[DictConfig]:
    """Every job's config, in job order, as `compose(job)` (Hydra's `load_sweep_config`) gives it.

    `compose_first(jobs)` composes the first job of each signature (None where it cannot);
    each other job is set on a copy of its signature's first job's config, or composed by
    `compose` where it cannot be. A job that cannot be composed raises Hydra's error from
    `compose`, the first such job in job order."""
    parsed = [plain.parse(job) for job in jobs]
    first_of: dict[tuple, int] = {}
    for i, overrides in enumerate(parsed):
        first_of.setdefault(plain.signature(overrides), i)
    firsts = sorted(set(first_of.values()))
    composed = dict(zip(firsts, compose_first([list(jobs[i]) for i in firsts])))
    configs = []
    for i, overrides in enumerate(parsed):
        first = first_of[plain.signature(overrides)]
        config = composed[first] if first == i else None
        if config is None and first != i and composed[first] is not None:
            config = with_values(composed[first], parsed[first], overrides, master)
        configs.append(config if config is not None else compose(list(jobs[i])))
    return configs


def with_values(template: DictConfig, template_job: Sequence[Override], job: Sequence[Override],
                master: DictConfig) -> DictConfig | None:
    """`job`'s config from `template`, the config Hydra composed for `template_job` (overrides of
    the same signature): its differing plain values set by Hydra's override step, its
    `hydra.overrides.task` and `hydra.job.override_dirname` as Hydra writes them, the master
    config's resolver cache as `load_sweep_config` copies it. None where a value cannot be set
    so (a key Hydra's choices name, no leaf there, a key nested in another override's, or a
    value the config refuses): compose that job in full."""
    choices = template.hydra.runtime.choices
    changed = [o for t, o in zip(template_job, job) if t.input_line != o.input_line]
    # The keys Hydra sets after composing (all but a group's choice), in the order it sets them.
    set_keys = [o.key_or_group for o in job if o.key_or_group not in choices or isinstance(o.value(), dict)]
    for o in changed:
        key = o.key_or_group
        # A leaf that Hydra sets once: not a group's choice (which is no set key), and no other
        # set key above or below it.
        if not isinstance(_node(template, key), ValueNode):
            return None
        if sum(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in set_keys) != 1:
            return None
    config = copy.deepcopy(template)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(changed, config)
    except Exception:
        return None
    app_overrides = [o for o in job if not o.is_hydra_override()]
    with open_dict(config.hydra):
        config.hydra.overrides.task.clear()
        for o in app_overrides:
            config.hydra.overrides.task.append(o.input_line)
        dirname = config.hydra.job.config.override_dirname
        config.hydra.job.override_dirname = get_overrides_dirname(
            overrides=app_overrides, kv_sep=dirname.kv_sep, item_sep=dirname.item_sep,
            exclude_keys=dirname.exclude_keys)
    OmegaConf.copy_cache(from_config=master, to_config=config)
    return config


def _node(config: DictConfig, key: str):
    """The node at dotted `key`, None where there is none."""
    node = config
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node._get_node(part)
    return node
