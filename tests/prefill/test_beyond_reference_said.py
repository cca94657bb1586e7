"""A prefill case the reference's kernels would refuse says so in result.json's case, on the
console and on the page; the canonical case says nothing."""

from __future__ import annotations

from hydra import compose, initialize_config_module

import launcher.cli  # noqa: F401  (registers the schemas)
from launcher.config.spec import run_spec
from launcher.report import console, run_page


def _case_entry(tmp_path, *overrides: str) -> dict:
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="config", overrides=["phase=prefill", "model=tiny", *overrides])
    return run_spec(cfg, str(tmp_path)).case_entry()


def _refused(case: dict) -> dict:
    """A result no rank ran for: the console and the page still show the case's lines."""
    return {"case": case, "status": "config-error", "error": {"message": "stop"}, "wall_s": 0.0}


def test_a_case_beyond_the_reference_says_so_everywhere(tmp_path):
    case = _case_entry(tmp_path, "layer=hca", "cp=2", "prefix=300", "segment_lens=[200,77,256,130]")
    notes = case["beyond_reference"]
    assert any("prefix=300" in n for n in notes) and any("shorter than the window" in n for n in notes)
    assert "beyond the reference: prefix=300" in console.render(_refused(case))
    assert "beyond the reference: prefix=300" in run_page.render(_refused(case))


def test_the_canonical_case_says_nothing(tmp_path):
    case = _case_entry(tmp_path, "layer=swa", "cp=2")
    assert "beyond_reference" not in case
    assert "beyond the reference" not in console.render(_refused(case))
    assert "beyond the reference" not in run_page.render(_refused(case))
