"""Reference snapshots made by the public reference itself, small enough to ship in the repository.

    python -O scripts/reference_snapshots.py --reference PATH --out tests/data/reference \
        [--layers swa,csa,hca,moe,prefill-swa,prefill-hca]

PATH is a checkout of pypto-lib (https://github.com/hw-native-sys/pypto-lib); nothing of it is
copied here. For each decode layer this script imports the reference's
`models/deepseek_v4_flash_dspark/decode_<layer>.py` in a fresh process and calls, as its
`__main__` does for a TP run,

    specs = build_distributed_tensor_specs(LOCAL_T)     # every TP rank's fixture, rank-stacked
    golden_decode_<layer>(tensors)                      # the TP1 golden of each rank's shard

for the MoE layer `moe.py`'s `build_tensor_specs(layer_id, num_tokens)` (seeded with
`torch.manual_seed`) and `golden_moe`, and for the CP prefill layers
`models/deepseek_v4_flash_mtp/prefill_cp_<layer>.py`'s `build_tensor_specs(cp)` (seeded by
itself) and `golden_prefill_cp_<layer>`, the zigzag layout's canonical case at cp=2; then writes
`<out>/<layer>-tp2-mini/` (`moe-ep2-tiny/`, `prefill-<layer>-cp2-mini/`)
in the reference golden-harness layout (`in/<name>.pt`: inputs, in-out tensors before the
golden, scalars as 0-dim tensors; `out/<name>.pt`: outputs after it) with a `reference.json`
naming the commit, the command, every model field and deployment constant used and each
file's sha256.

The reference's dims are module constants: its `config.py` is imported first and its FLASH
preset and deployment constants changed by MODEL_FIELDS and CONSTANTS below (MOE_FIELDS for the
MoE; the project's `mini` and `tiny` presets hold the same values), before any model module
reads them; the prefill's mtp `config.py` the same way with PREFILL_CONSTANTS, its raw-KV pool
cut to the `mini` preset's `prefill_ori_block_num` pages. HCA's and SWA's own context ceiling
(`MAX_SEQ_LEN`, 1M in the reference) and the table widths derived from it are set on the module
after its import. The reference's kernels need pypto (a device compiler); its fixture and golden
are plain torch: `reference_run.stub_pypto` lets its modules import. Run with `python -O`: the
reference asserts kernel tile sizes (hc_pre) that reduced dims do not meet and its golden never
uses. Its golden runs on PYPTO_GOLDEN_NUM_THREADS=2 threads with MKL_CBWR=AVX2,STRICT, as the
harness's CPU goldens do.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys

from reference_run import stub_pypto

TP = 2
LOCAL_T = 32  # four requests per rank: the start sets' long-context, cold-start and boundary cases
THREADS = 2
# The global torch seed set before the fixture: CSA's builder draws from the global generator
# without seeding it (SWA's and HCA's seed per rank themselves), so this makes CSA's repeatable.
SEED = 20260819
LAYERS = ("swa", "csa", "hca", "moe", "prefill-swa", "prefill-hca", "prefill-csa")

# The MoE case: a score-routed layer (past FLASH's 3 hash layers) on 96 of its 128 tokens, over
# ep=2; dims of the project's `tiny` preset (hidden 256, expert width 128, vocab 2048), whose
# MoE modules, unlike the O projection, accept them. Every other field and constant is FLASH's.
MOE_EP = 2
MOE_CASE = {"layer_id": 4, "num_tokens": 96}
MOE_SEED = 5
MOE_FIELDS = {"hidden_size": 256, "moe_intermediate_size": 128, "vocab_size": 2048}

# The reference's FLASH preset with these fields changed. hidden_size 512, o_lora_rank 256 and a
# 256-wide output group (heads * head_dim / o_groups) are the least the reference's O projection
# module accepts (its tile checks raise at import): two groups of four 64-wide heads, split over
# tp=2; the other widths are halved where nothing refuses them.
MODEL_FIELDS = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "head_dim": 64,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 128,
    "o_lora_rank": 256,
    "o_groups": 2,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 128,
    "max_position_embeddings": 1024,  # CSA ships the whole RoPE table: 1024 rows, not 16384
}

# Deployment constants of the reference's config.py changed (the rest are FLASH's). A decode
# batch of 32 is the least whose per-rank token capacity (128 at tp=2) the O projection's
# 128-row token tile divides; the pools hold 16 to 36 pages, the least each fixture fits
# (requests wrap into them, as the reference's own 512-page pool wraps 64 requests), and the
# long-context start is 512.
CONSTANTS = {
    "DECODE_BATCH": 32,
    "DECODE_START_POS": 512,
    "KV_ORI_BLOCK_NUM": 20,
    "KV_CMP_BLOCK_NUM": 16,
    "IDX_CACHE_BLOCK_NUM": 16,
    "HCA_STATE_PHYSICAL_BLOCKS": 16,
    "CSA_STATE_PHYSICAL_BLOCKS": 36,
    "CSA_INNER_STATE_PHYSICAL_BLOCKS": 36,
}
# The CP prefill (the mtp tree's config.py): cp=2 (its default) and the raw-KV pool of pages of
# BLOCK_SIZE = 128 rows cut from 128 pages to 8, the reference's own rule (one page per 128 RoPE
# positions) at the 1024-row table; every other pool is FLASH's (the compressed-row pool of 32
# pages, HCA's state pool of 64), as the harness's prefill layers hold them.
PREFILL_CP = 2
PREFILL_CONSTANTS = {"ORI_KV_BLOCK_NUM": 8}
# The context ceiling HCA's (and SWA's) module fixes at 1M; the state block table is this wide.
LONG_CONTEXT_MAX_SEQ_LEN = 16384


DECODE_TREE = ("deepseek_v4_flash_dspark", "decode_swa.py")  # a model tree and a file it must hold
PREFILL_TREE = ("deepseek_v4_flash_mtp", "prefill_cp_swa.py")


def _configure(reference: str, fields: dict, constants: dict, tree: tuple[str, str] = DECODE_TREE):
    """Import the reference's config (of its model tree `tree`) with these values in place; its
    model modules read them at their own import."""
    model_dir = os.path.join(reference, "models", tree[0])
    if not os.path.isfile(os.path.join(model_dir, tree[1])):
        raise SystemExit(f"{reference} is not a pypto-lib checkout: {model_dir}/{tree[1]} is missing")
    os.environ["PYPTO_GOLDEN_NUM_THREADS"] = str(THREADS)
    # MKL's fp32 GEMMs on their AVX2 path in strict (reproducible) mode, as the harness's
    # ranks run them (launcher/run/forkserver.py); MKL reads it at its first GEMM.
    os.environ["MKL_CBWR"] = "AVX2,STRICT"
    stub_pypto()
    sys.path[:0] = [model_dir, reference]
    import config

    config.FLASH = dataclasses.replace(config.FLASH, **fields)
    for name, value in constants.items():
        setattr(config, name, value)
    # The constants config.py derives from those changed, by its own formulas.
    block = config.BLOCK_SIZE
    mpe = config.FLASH.max_position_embeddings
    config.DECODE_TOKENS = config.DECODE_BATCH * config.DECODE_SEQ
    if tree == PREFILL_TREE:  # the mtp tree's formulas: one table block per 128 positions
        config.KV_ORI_TABLE_MAX_BLOCKS = (mpe + block - 1) // block
        config.KV_ORI_MAX_BLOCKS = config.KV_CMP_MAX_BLOCKS = config.KV_ORI_TABLE_MAX_BLOCKS
        config.IDX_CACHE_MAX_BLOCKS = config.KV_ORI_TABLE_MAX_BLOCKS
        config.DECODE_ORI_BLOCK_NUM = config.PREFILL_ORI_BLOCK_NUM = config.ORI_KV_BLOCK_NUM
        config.PREFILL_ORI_MAX_BLOCKS = config.KV_ORI_TABLE_MAX_BLOCKS
        config.PREFILL_CMP_MAX_BLOCKS = config.KV_CMP_MAX_BLOCKS
        config.PREFILL_IDX_MAX_BLOCKS = config.IDX_CACHE_MAX_BLOCKS
        return config
    config.KV_ORI_MAX_BLOCKS = (mpe + block - 1) // block
    config.KV_CMP_MAX_BLOCKS = (mpe // 4 + block - 1) // block
    config.IDX_CACHE_MAX_BLOCKS = 2 * config.KV_CMP_MAX_BLOCKS
    return config


def _set_context_ceiling(module) -> None:
    """HCA's and SWA's own 1M ceiling and the table widths their modules derive from it."""
    if not hasattr(module, "MAX_SEQ_LEN") or module.MAX_SEQ_LEN != 1_048_576:
        return
    module.MAX_SEQ_LEN = LONG_CONTEXT_MAX_SEQ_LEN
    if hasattr(module, "ORI_TABLE_BLOCKS"):
        module.ORI_TABLE_BLOCKS = (LONG_CONTEXT_MAX_SEQ_LEN + module.BLOCK_SIZE - 1) // module.BLOCK_SIZE
    if hasattr(module, "COMPRESS_STATE_MAX_BLOCKS"):
        size = module.COMPRESS_STATE_BLOCK_SIZE
        module.COMPRESS_STATE_MAX_BLOCKS = (LONG_CONTEXT_MAX_SEQ_LEN + size - 1) // size


def _commit(reference: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", reference, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _import(module_name: str, argv: list[str]):
    """The reference module, imported with the command line its module-level parsing reads."""
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]
    try:
        return importlib.import_module(module_name)
    finally:
        sys.argv = saved


def _decode_case(reference: str, layer: str):
    """A decode layer's specs and tensors after the reference's golden, and what to record."""
    config = _configure(reference, MODEL_FIELDS, CONSTANTS | {"TP": TP})
    import torch

    module = _import(f"decode_{layer}", ["--tp", str(TP)])
    _set_context_ceiling(module)
    torch.manual_seed(SEED)
    specs = module.build_distributed_tensor_specs(LOCAL_T)
    record = {"made_by": f"pypto-lib models/deepseek_v4_flash_dspark/decode_{layer}.py: "
                         f"build_distributed_tensor_specs and golden_decode_{layer}",
              "layer": layer, "tp": TP, "local_t": LOCAL_T, "start_pos": None, "global_seed": SEED,
              "long_context_max_seq_len": LONG_CONTEXT_MAX_SEQ_LEN}
    return config, specs, getattr(module, f"golden_decode_{layer}"), f"{layer}-tp{TP}-mini", "mini", record


def _moe_case(reference: str):
    config = _configure(reference, MOE_FIELDS, {})
    import torch

    module = _import("moe", ["--ep", str(MOE_EP)])
    torch.manual_seed(MOE_SEED)
    specs = module.build_tensor_specs(**MOE_CASE)
    record = {"made_by": "pypto-lib models/deepseek_v4_flash_dspark/moe.py: build_tensor_specs and golden_moe",
              "layer": "moe", "ep": MOE_EP, **MOE_CASE, "seed": MOE_SEED}
    return config, specs, module.golden_moe, f"moe-ep{MOE_EP}-tiny", "tiny", record


def _prefill_case(reference: str, layer: str):
    """A CP prefill layer's canonical case (zigzag, no history, segments of one window) at cp=2:
    its specs and the golden, the golden's context installed as the reference's __main__ does."""
    config = _configure(reference, MODEL_FIELDS, PREFILL_CONSTANTS, PREFILL_TREE)
    module = _import(f"prefill_cp_{layer}", ["--cp", str(PREFILL_CP)])
    golden = getattr(module, f"golden_prefill_cp_{layer}")
    built = module.build_tensor_specs(PREFILL_CP)
    if isinstance(built, tuple):  # SWA hands the golden's context back; HCA installs it itself
        built, golden._ctx = built
    record = {"made_by": f"pypto-lib models/deepseek_v4_flash_mtp/prefill_cp_{layer}.py: "
                         f"build_tensor_specs and golden_prefill_cp_{layer}",
              "layer": layer, "phase": "prefill", "cp": PREFILL_CP, "cp_layout": "zigzag",
              "seeded_by": "the builder's own torch.manual_seed(4100 + 31 * cp)"}
    return config, built, golden, f"prefill-{layer}-cp{PREFILL_CP}-mini", "mini", record


def _case(reference: str, layer: str):
    if layer == "moe":
        return _moe_case(reference)
    if layer.startswith("prefill-"):
        return _prefill_case(reference, layer.removeprefix("prefill-"))
    return _decode_case(reference, layer)


def make_one(reference: str, layer: str, out: str) -> None:
    """One layer's snapshot, in this process (a fresh one: the reference's modules are
    configured once, at import)."""
    config, specs, golden, name, model_name, record = _case(reference, layer)
    import torch
    from golden import ScalarSpec

    torch.set_num_threads(THREADS)
    tensors = {s.name: s.to_python() if isinstance(s, ScalarSpec) else s.create_tensor() for s in specs}
    before = {s.name: tensors[s.name].clone() for s in specs
              if not isinstance(s, ScalarSpec) and not (s.is_output and s.init_value is None)}
    golden(tensors)

    folder = os.path.join(out, name)
    os.makedirs(os.path.join(folder, "in"), exist_ok=False)
    os.makedirs(os.path.join(folder, "out"))
    inputs, outputs = [], []
    for spec in specs:
        if isinstance(spec, ScalarSpec):
            torch.save(torch.tensor(tensors[spec.name], dtype=spec.dtype), os.path.join(folder, "in", f"{spec.name}.pt"))
            inputs.append(spec.name)
            continue
        if spec.name in before:
            torch.save(before[spec.name].contiguous(), os.path.join(folder, "in", f"{spec.name}.pt"))
            inputs.append(spec.name)
        if spec.is_output:
            torch.save(tensors[spec.name].contiguous(), os.path.join(folder, "out", f"{spec.name}.pt"))
            outputs.append(spec.name)
    record = {
        "made_by": f"{record.pop('made_by')}, run by scripts/reference_snapshots.py",
        "commit": _commit(reference),
        "command": f"python -O scripts/reference_snapshots.py --reference PATH --layers {layer}",
        **record,
        "model": dataclasses.asdict(config.FLASH) | {"name": model_name},
        "constants": {k: v for k, v in vars(config).items() if k.isupper() and isinstance(v, (int, float))},
        "torch": torch.__version__, "threads": THREADS,
        "inputs": inputs, "outputs": outputs,
        "sha256": {f"{sub}/{n}": _sha256(os.path.join(folder, sub, n))
                   for sub in ("in", "out") for n in sorted(os.listdir(os.path.join(folder, sub)))},
    }
    with open(os.path.join(folder, "reference.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"{folder}: {len(inputs)} inputs, {len(outputs)} outputs")


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="a pypto-lib checkout")
    ap.add_argument("--out", default="tests/data/reference")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: the layer this child process makes
    args = ap.parse_args()
    if sys.flags.optimize == 0:
        raise SystemExit("run with python -O (the reference asserts kernel tile sizes its golden does not use)")
    if args.one:
        make_one(os.path.abspath(args.reference), args.one, args.out)
        return
    for layer in args.layers.split(","):
        if layer not in LAYERS:
            raise SystemExit(f"--layers: {layer!r} is not one of {', '.join(LAYERS)}")
        subprocess.run([sys.executable, "-O", __file__, "--reference", args.reference, "--out", args.out,
                        "--one", layer], check=True)


if __name__ == "__main__":
    main()
