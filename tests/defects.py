"""Implementations under test with one deliberate defect each (for negative end-to-end tests).

Each is the default TP implementation with one stage replaced by name (`TorchTP.run_stage`),
so the golden (the layer's own stages) stays the reference and bisect judges the replaced
stage. The workers import this module by name, as they would a user's implementation.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from hydra.experimental.callback import Callback

from layers.hca import layer as hca
from layers.components import hca_compressor
from layers.components.numerics import bf16
from layers.components.moe_routing import block_transpose
from layers.distributed import wire
from layers.tp import TorchTP


def _shift(slots: torch.Tensor) -> torch.Tensor:
    return torch.where(slots >= 0, slots + 1, slots)


class StageDefect(TorchTP):
    """The default implementation with the stages named in `stages` replaced by `defective`."""

    stages: tuple[str, ...]

    def defective(self, stage, ctx, values) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def run_stage(self, stage, ctx, values):
        if stage.name in self.stages:
            return self.defective(stage, ctx, values)
        return super().run_stage(stage, ctx, values)


class ReduceScatterWithoutSum(StageDefect):
    """Each owner keeps only its own partial: the other ranks' groups are never added."""

    stages = ("reduce_scatter",)

    def defective(self, stage, ctx, v):
        t = v["o_partial"].shape[0] // ctx.tp
        return {"attn_out": bf16(v["o_partial"][ctx.rank * t : (ctx.rank + 1) * t])}


class GroupsToWrongRank(StageDefect):
    """The head-group all-to-all delivers every rank's groups to the next rank."""

    stages = ("group_all_to_all",)

    def defective(self, stage, ctx, v):
        lg = v["attention_grouped"].shape[0] // ctx.tp
        return stage.run(ctx, {"attention_grouped": torch.roll(v["attention_grouped"], shifts=lg, dims=0)})


class PerturbRankTokens(TorchTP):
    """Rank 1 returns a slightly wrong x_out for its first request's tokens."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            seq = ctx.case.seq
            out["x_out"][:seq] = out["x_out"][:seq] * 1.5 + 0.25
        return out


class SkipCacheWrite(StageDefect):
    """The kv cache insert never happens."""

    stages = ("cache_insert",)

    def defective(self, stage, ctx, v):
        return {"kv_cache": v["kv_cache"]}


class CacheWriteWrongSlot(StageDefect):
    """The kv cache insert lands one row after the slot mapping's."""

    stages = ("cache_insert",)

    def defective(self, stage, ctx, v):
        mapping = next(n for n in stage.reads if n.endswith("slot_mapping"))
        return stage.run(ctx, {**v, mapping: _shift(v[mapping])})


class CsaMissedCommit(StageDefect):
    """The CSA main compressor never commits its compressed rows into cmp_kv."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        before = v["cmp_kv"].clone()
        out = stage.run(ctx, v)
        out["cmp_kv"].copy_(before)
        return out


class CsaStateWrongSlot(StageDefect):
    """The CSA compressors write their state one row after the state slot mapping's."""

    stages = ("compressor", "indexer_compressor")

    def defective(self, stage, ctx, v):
        mapping = "state_slot_mapping" if stage.name == "compressor" else "inner_state_slot_mapping"
        return stage.run(ctx, {**v, mapping: _shift(v[mapping])})


class CsaSentinelOverwritten(StageDefect):
    """Besides their own rows, the CSA compressors zero their state pool's last row (a
    never-used, -inf sentinel row)."""

    stages = ("compressor", "indexer_compressor")

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)
        state = "compress_state" if stage.name == "compressor" else "inner_compress_state"
        out[state].view(-1, out[state].shape[-1])[-1] = 0.0
        return out


class CsaTopkOffByOne(StageDefect):
    """The indexer's top-k returns every selected slot shifted by one."""

    stages = ("indexer_topk",)

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)
        return {**out, "idx_topk": _shift(out["idx_topk"])}


class HcaMissedCommit(StageDefect):
    """The HCA compressor never commits its compressed rows into cmp_kv."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        before = v["cmp_kv"].clone()
        out = stage.run(ctx, v)
        out["cmp_kv"].copy_(before)
        return out


class HcaPoolsWrongRows(StageDefect):
    """The HCA compressor pools the state rows one position late."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        def late(table, request, pool_pos, block_size):
            return hca_compressor.window_state_rows(table, request, pool_pos + 1, block_size)

        return hca.compressor(ctx, v, window_rows=late)


class HcaWrongRopePosition(StageDefect):
    """The HCA compressed rows are rotated with the previous row's angles."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        def rotate(y, cos, sin, model):
            return hca_compressor.rope_compressed(y, torch.roll(cos, 1, 0), torch.roll(sin, 1, 0), model)

        return hca.compressor(ctx, v, rotate=rotate)


class ExitOnRank1(TorchTP):
    """Rank 1's implementation calls sys.exit(0) instead of returning its outputs."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            sys.exit(0)
        return super().__call__(ctx, tensors)


class Rank1DiesThenRank0Fails(TorchTP):
    """Rank 1 ends at once; rank 0 takes a moment before it raises an error of its own (a
    peer still writing its report when the first death is seen)."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            os._exit(3)
        time.sleep(0.5)
        raise ValueError("rank 0's own error, reported after its peer died")


class SlowToExitOnRank1(TorchTP):
    """Rank 1 raises; on its way out it closes its connections at once and then takes a second
    to end (a slow teardown), so its peer's collective breaks well before rank 1 has exited."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            import atexit

            atexit.register(lambda: (dist.destroy_process_group(), time.sleep(1.0)))
            raise ValueError("rank 1's own error")
        return super().__call__(ctx, tensors)


def openblas_threads() -> int | None:
    """How many threads numpy's OpenBLAS runs in this process (None: none is loaded)."""
    import ctypes

    with open("/proc/self/maps") as maps:
        libraries = sorted({line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]})
    for path in libraries:
        for symbol in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
            get = getattr(ctypes.CDLL(path), symbol, None)
            if get is not None:
                return get()
    return None


def process_state() -> list:
    """Whether the garbage collector is on, how many objects it has frozen, OpenBLAS's threads."""
    import gc

    return [gc.isenabled(), gc.get_freeze_count(), openblas_threads()]


class RecordsProcessState(TorchTP):
    """Not a defect, a probe: writes the rank's `process_state()` to
    `$DSV4_TEST_PROCESS_STATE.rank<r>`, then runs the layer."""

    def __call__(self, ctx, tensors):
        import json

        with open(f"{os.environ['DSV4_TEST_PROCESS_STATE']}.rank{ctx.rank}", "w") as f:
            json.dump(process_state(), f)
        return super().__call__(ctx, tensors)


class RecordsLauncherState(Callback):
    """A Hydra callback, in the launcher: writes its `process_state()` to
    `$DSV4_TEST_PROCESS_STATE.launcher` as the job starts."""

    def on_job_start(self, config, **kwargs):
        import json

        with open(f"{os.environ['DSV4_TEST_PROCESS_STATE']}.launcher", "w") as f:
            json.dump(process_state(), f)


class BusyOnRank0IdleOnRank1(TorchTP):
    """Not a defect, a probe of the stage clocks: before the layer, rank 0 computes for 0.3 s
    of its CPU and rank 1 sleeps 0.3 s."""

    def __call__(self, ctx, tensors):
        start = time.process_time()
        if ctx.rank == 0:
            while time.process_time() - start < 0.3:
                pass
        else:
            time.sleep(0.3)
        return super().__call__(ctx, tensors)


class InterruptOnRank1(TorchTP):
    """Rank 1's implementation raises KeyboardInterrupt itself (no signal was sent)."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            raise KeyboardInterrupt
        return super().__call__(ctx, tensors)


class ExtraCollectiveOnRank1(TorchTP):
    """After a correct layer, rank 1 enters one more collective, which its peers never do."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            dist.all_reduce(torch.zeros(1), group=ctx.group)
        return out


# -- defects that only several TP groups in one launch (dp x tp) reveal -----------------------------
class GroupSliceByGlobalRank(StageDefect):
    """The all-to-all picks its output groups by the global rank (clamped into the group), not the
    rank inside the TP group: right in group 0, wrong in every later one."""

    stages = ("group_all_to_all",)

    def defective(self, stage, ctx, v):
        every = wire.all_gather(v["attention_grouped"], ctx.group, ctx.tp)  # [P, G, t, GI]
        p, g, t, gi = every.shape
        lg = g // p
        rank = min(ctx.global_rank, p - 1)
        return {"attention_local_groups": every[:, rank * lg : (rank + 1) * lg].permute(1, 0, 2, 3).reshape(lg, p * t, gi)}


class ReduceOnTheWorldGroup(StageDefect):
    """The reduce-scatter sums the partials of every rank of the world, not of the TP group."""

    stages = ("reduce_scatter",)

    def defective(self, stage, ctx, v):
        import torch.distributed as dist

        total = v["o_partial"].clone()
        dist.all_reduce(total, group=dist.group.WORLD)
        t = total.shape[0] // ctx.tp
        return {"attn_out": bf16(total[ctx.rank * t : (ctx.rank + 1) * t])}


class PerturbGroup1Rank1(TorchTP):
    """Rank 1 of TP group 1 returns a slightly wrong x_out for its first request's tokens."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.group_index == 1 and ctx.rank == 1:
            seq = ctx.case.seq
            out["x_out"][:seq] = out["x_out"][:seq] * 1.5 + 0.25
        return out


# -- MoE defects (moe.md §10's pitfalls) ---------------------------------------------------------------
class MoeRoutesToTheWrongRank(StageDefect):
    """Every route goes to the next rank's expert of the same local id."""

    stages = ("dispatch",)

    def defective(self, stage, ctx, v):
        experts = ctx.case.routed_experts
        return stage.run(ctx, {**v, "indices": (v["indices"] + ctx.case.local_experts) % experts})


class MoeCombineReusesDispatchSplits(StageDefect):
    """The combine sends the routed rows back with the dispatch's splits, not the swapped ones
    (buffers cut or padded to fit: sizes agree pairwise, rows land wrongly)."""

    stages = ("combine",)

    def defective(self, stage, ctx, v):
        recv_y, recv_meta, send_meta, send_route = v["recv_y"], v["recv_meta"], v["send_meta"], v["send_route"]
        back = recv_y[block_transpose(recv_meta.t())]
        s, d = int(send_meta.sum()), recv_y.shape[1]

        def fit(x):
            return torch.cat((x[:s], x.new_zeros(max(0, s - x.shape[0]), d)))

        rows = wire.all_to_all_v(fit(back), send_meta.sum(1).tolist(), recv_meta.sum(1).tolist(), ctx.group, ctx.tp)
        buf = torch.zeros(ctx.case.tokens * ctx.model.num_experts_per_tok, d, dtype=torch.bfloat16)
        buf[send_route.long()] = fit(rows)
        return {"routed_y_buf": buf}


class MoeDropsTheRoutingWeight(StageDefect):
    """The routed experts ignore the routing weight (weight 1 on every row)."""

    stages = ("routed_experts",)

    def defective(self, stage, ctx, v):
        aux = v["recv_aux"].clone()
        aux[:, 1] = 1.0
        return stage.run(ctx, {**v, "recv_aux": aux})


class MoeProcessesTokensPastNumTokens(TorchTP):
    """Rank 1 routes and reduces every one of its T tokens, active or not."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            tensors = {**tensors, "num_tokens": torch.tensor(ctx.case.tokens, dtype=torch.int32)}
        return super().__call__(ctx, tensors)


# -- defects inside the reference's pooled budgets (integrity checks) ----------------------------
class CacheTamperedAfterAttention(StageDefect):
    """The kv cache insert runs and attention reads the right rows, so x_out is right; then
    `tamper` changes the cache rows of `tokens` on each rank of `ranks` (a copy of the rows,
    written back), as a kernel that attends over its fresh kv but botches the cache write."""

    stages = ("cache_insert", "attention")
    ranks: tuple[int, ...] = (1,)
    groups: tuple[int, ...] | None = None  # the TP groups of a dp x tp launch it tampers in (None: all)
    tokens = slice(-2, None)  # the rank's last two tokens

    def tamper(self, rank: int, rows: torch.Tensor, before: torch.Tensor) -> None:
        raise NotImplementedError

    def defective(self, stage, ctx, v):
        flat = v["kv_cache"].view(-1, v["kv_cache"].shape[-1])
        if stage.name == "cache_insert":
            mapping = v[next(n for n in stage.reads if n.endswith("slot_mapping"))]
            slots = mapping[self.tokens]
            self._slots = slots[slots >= 0].to(torch.int64)
            self._before = flat[self._slots].clone()
            return stage.run(ctx, v)
        out = stage.run(ctx, v)
        if ctx.rank in self.ranks and (self.groups is None or ctx.group_index in self.groups):
            rows = flat[self._slots]
            self.tamper(ctx.rank, rows, self._before)
            flat[self._slots] = rows
        return out


class SkipTokenCacheWrites(CacheTamperedAfterAttention):
    """Rank 1 never writes its last two tokens' kv cache rows: they keep their value from
    before the step (inside the pooled 0.5 % budget at small and flash dims)."""

    def tamper(self, rank, rows, before):
        rows.copy_(before)


class HugeValueInCache(CacheTamperedAfterAttention):
    """Rank 1 writes 1e30 into one value of its last token's kv cache row."""

    tokens = slice(-1, None)

    def tamper(self, rank, rows, before):
        rows[0, 0] = 1e30


class HugeValueInGroup1Cache(HugeValueInCache):
    """HugeValueInCache in TP group 1 of a dp x tp launch only."""

    groups = (1,)


class SkipWriteAndHugeValue(CacheTamperedAfterAttention):
    """Both at once, one token each: rank 0 writes 1e30 into its last token's kv cache row,
    rank 1 never writes its last token's row."""

    ranks = (0, 1)
    tokens = slice(-1, None)

    def tamper(self, rank, rows, before):
        if rank == 1:
            rows.copy_(before)
        else:
            rows[0, 0] = 1e30


class CorruptPureInputs(TorchTP):
    """Rank 1 computes the right outputs, then scales its wq_a by -3 and shifts its slot
    mapping by 7 in place (pure inputs: the contract lets only the in-out tensors change)."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            tensors["wq_a"].mul_(-3)
            mapping = next(n for n in tensors if n.endswith("slot_mapping"))
            tensors[mapping].add_(7)
        return out


class MoeHugeValueInXNext(TorchTP):
    """Rank 1 writes 1e30 into one value of its x_next: one point of the pooled 5 % budget, and
    ratio_reldiff puts no cap on a single point of the MoE layer."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            out["x_next"][0, 0, 0] = 1e30
        return out


class MoeCorruptsItsInputs(TorchTP):
    """Rank 1 computes the right x_next, then scales its x_hc by -3 and shifts its input_ids by
    7 in place (both pure inputs)."""

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            tensors["x_hc"].mul_(-3)
            tensors["input_ids"].add_(7)
        return out


# -- what `impl=` may name (launcher.run.preflight.implementation) ------------------------------------
def torch_tp_function(ctx, tensors):
    """The default implementation as a plain function: `impl=` naming a function runs it per rank."""
    return TorchTP()(ctx, tensors)


def takes_nothing():
    """Not an implementation: it cannot be called as (ctx, tensors)."""


class NotCallable:
    """Not an implementation: its instances cannot be called."""


NOT_AN_IMPLEMENTATION = 3


class CrashOnRank1(TorchTP):
    """Rank 1's process dies in the middle of the layer, as a segfault would end it."""

    def __call__(self, ctx, tensors):
        if ctx.rank == 1:
            os._exit(7)
        return super().__call__(ctx, tensors)


class KillJobProcess:
    """Kills the process that runs the job with SIGKILL (a rank's parent is the forkserver,
    whose parent is the job's process)."""

    def __call__(self, ctx, tensors):
        with open(f"/proc/{os.getppid()}/stat") as f:
            job_pid = int(f.read().rsplit(")", 1)[1].split()[1])
        os.kill(job_pid, signal.SIGKILL)
        time.sleep(60)


# What `ChangesProcessState` leaves behind; `ExpectsFreshProcessState` refuses to run in it.
LEFT_BEHIND_ENV = "DSV4_TEST_LEFT_BY_AN_EARLIER_JOB"
LEFT_BEHIND_SEED = 12345


class ChangesProcessState(TorchTP):
    """Correct outputs, and then process-wide state changed through public APIs, which a warm
    rank must put back before its next job."""

    def __call__(self, ctx, tensors):
        outputs = super().__call__(ctx, tensors)
        os.environ[LEFT_BEHIND_ENV] = "1"
        os.chdir("/")
        torch.manual_seed(LEFT_BEHIND_SEED)
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("medium")
        return outputs


class ExpectsFreshProcessState(TorchTP):
    """The default implementation, refusing to run where an earlier job's state is still there."""

    def __call__(self, ctx, tensors):
        left = {"environment": LEFT_BEHIND_ENV in os.environ, "cwd": os.getcwd() == "/",
                "seed": torch.initial_seed() == LEFT_BEHIND_SEED, "dtype": torch.get_default_dtype() != torch.float32,
                "grad mode": not torch.is_grad_enabled(), "determinism": torch.are_deterministic_algorithms_enabled(),
                "matmul precision": torch.get_float32_matmul_precision() != "highest"}
        if any(left.values()):
            raise RuntimeError(f"an earlier job's process state is still here: {[k for k, v in left.items() if v]}")
        return super().__call__(ctx, tensors)


# -- implementations that replace a function the golden also runs (launcher.run.golden_guard) --------------
# `tests.kernel_patch` replaces it on import, as a kernel library would; it is a module of its own
# because importing this one must change nothing.
import layers.components.qkv  # noqa: E402

_HARNESS_RMS_NORM = layers.components.qkv.rms_norm


def fast_rms_norm(x, norm_w, eps):
    """A kernel library's attention RMSNorm, up to 5 % off the harness's: a ramp over the features
    (a uniform scale would vanish in the norms that follow it)."""
    normed = _HARNESS_RMS_NORM(x, norm_w, eps).float()
    return bf16(normed * torch.linspace(0.95, 1.05, normed.shape[-1], device=normed.device))


def patch_rms_norm():
    """Replace the harness's RMSNorm, which the golden and the default implementation both call."""
    layers.components.qkv.rms_norm = fast_rms_norm


class PatchesNormInConstructor(TorchTP):
    """Replaces the harness's RMSNorm when built, then runs the default implementation with it."""

    def __init__(self):
        patch_rms_norm()


class PatchesNormDuringCall(TorchTP):
    """Replaces the harness's RMSNorm in its call, and leaves it replaced."""

    def __call__(self, ctx, tensors):
        patch_rms_norm()
        return super().__call__(ctx, tensors)


class PatchesNormWhenDropped(TorchTP):
    """Correct; replaces the harness's RMSNorm when the harness lets go of it, after every check
    of its job."""

    def __del__(self):
        patch_rms_norm()


class HoldsTheLauncherAfterItsResult(Callback):
    """A Hydra callback, in the launcher: once the job has written its result, creates
    `$DSV4_TEST_HOLD.held` and waits for `$DSV4_TEST_HOLD.go` (at most 300 s), so that a test
    can start a second launcher while this one still runs."""

    def on_job_end(self, config, job_return, **kwargs):
        base = os.environ["DSV4_TEST_HOLD"]
        open(f"{base}.held", "w").close()
        deadline = time.monotonic() + 300
        while not os.path.exists(f"{base}.go") and time.monotonic() < deadline:
            time.sleep(0.05)


# -- stored zeros and a dropped route: inside the pooled budgets and the caps (stale_values, concentration) --
class ZeroKvTailColumns(CacheTamperedAfterAttention):
    """Rank 1 stores zeros in the last 16 columns of its last two tokens' kv cache rows (a
    kernel whose last vector store never happens): each row is written, so written_rows sees
    it changed, and a 0 never exceeds the cap 128 atol + |e|."""

    def tamper(self, rank, rows, before):
        rows[:, -16:] = 0


class ZeroKvRows(CacheTamperedAfterAttention):
    """Rank 1 stores zeros in its last two tokens' whole kv cache rows (SkipTokenCacheWrites
    with zeros for the old values)."""

    def tamper(self, rank, rows, before):
        rows.zero_()


class HcaStateHalfRowUnwritten(StageDefect):
    """Rank 1's HCA compressor writes only the first half of its last token's compressor-state
    row: the second half keeps its value from before the step (the pool's initial 0)."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        flat = v["compress_state"].view(-1, v["compress_state"].shape[-1])
        slot = int(v["state_slot_mapping"][-1])
        before = flat[slot].clone()
        out = stage.run(ctx, v)
        if ctx.rank == 1:
            half = flat.shape[1] // 2
            flat[slot, half:] = before[half:]
        return out


class MoeDropsLastRoute(StageDefect):
    """Rank 1's combine drops the last of the K routes of its first 8 tokens: their rows of
    routed_y_buf stay 0, so those tokens' x_next miss one expert's output (a logic defect whose
    bad points all sit in 8 token rows, inside the 5 % budget of x_next)."""

    stages = ("combine",)
    tokens = 8

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)
        if ctx.rank == 1:
            k = ctx.model.num_experts_per_tok
            out["routed_y_buf"][torch.arange(self.tokens) * k + k - 1] = 0
        return out


# The folder where `StartsAChildProcess` records the pid of each child it starts.
CHILD_PIDS_ENV = "DSV4_TEST_CHILD_PIDS"


class StartsAChildProcess(TorchTP):
    """Correct outputs, and a child process on every rank that would run for 1000 s (as a
    compile-worker pool or a helper server started with `subprocess.Popen` would outlive it);
    its pid goes to `$DSV4_TEST_CHILD_PIDS/rank<R>.pid`."""

    def __call__(self, ctx, tensors):
        import subprocess

        child = subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL)
        with open(os.path.join(os.environ[CHILD_PIDS_ENV], f"rank{ctx.rank}.pid"), "w") as f:
            f.write(str(child.pid))
        return super().__call__(ctx, tensors)


# A file `KillJobProcessOnceAFileExists` waits for before it kills its job's process.
KILL_AFTER_ENV = "DSV4_TEST_KILL_AFTER"


class KillJobProcessOnceAFileExists(KillJobProcess):
    """`KillJobProcess`, once the file `$DSV4_TEST_KILL_AFTER` exists (another job's progress
    file: that job is running then), or after 120 s without it."""

    def __call__(self, ctx, tensors):
        deadline = time.monotonic() + 120
        while not os.path.exists(os.environ[KILL_AFTER_ENV]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super().__call__(ctx, tensors)


# -- a defect synchronised on its peers' progress, not on the machine's speed -------------------
class ExtraCollectiveOnceRank0MovedOn(TorchTP):
    """ExtraCollectiveOnRank1, with rank 1 entering its extra collective only once rank 0's
    progress file (`progress`: the run's progress/rank0.jsonl) shows rank 0 in the gather stage:
    however loaded the machine, its peer has moved on when it is left behind."""

    def __init__(self, progress: str):
        self.progress = progress

    def _rank0_gathers(self) -> bool:
        import json  # this section's own: the file above is shared and only grows at its end

        try:
            with open(self.progress) as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        # A line still being written is not an event yet.
        return any(line.endswith("}") and json.loads(line)["phase"] == "gather" for line in lines)

    def __call__(self, ctx, tensors):
        out = super().__call__(ctx, tensors)
        if ctx.rank == 1:
            while not self._rank0_gathers():
                time.sleep(0.01)
            dist.all_reduce(torch.zeros(1), group=ctx.group)
        return out


# -- context-parallel prefill (layers/prefill): one defect of the CP protocol each ---------------
class PrefillMissingPredecessorTail(StageDefect):
    """Rank 1 never receives rank 0's tails: zeros where rank 0's segments' tails belong."""

    stages = ("tail_exchange",)

    def defective(self, stage, ctx, v):
        out = stage.run(ctx, v)["logical_tails_out"].clone()
        if ctx.rank == 1:
            from layers.prefill import tables  # this section's own: the file above only grows at its end

            owners = torch.tensor([tables.owner(ctx.case, s)[0] for s in range(ctx.case.num_segments)])
            out[owners == 0] = 0
        return {"logical_tails_out": out}


class PrefillLocalRopePositions(StageDefect):
    """RoPE at the rank-local row index instead of the token's global position."""

    stages = ("project",)

    def defective(self, stage, ctx, v):
        local = torch.arange(v["query_position_ids"].numel(), dtype=torch.int32).reshape(v["query_position_ids"].shape)
        return stage.run(ctx, {**v, "query_position_ids": local})


class PrefillFinalWindowOnOwnerOnly(StageDefect):
    """Only the rank that owns the last segment commits the final window into its kv_cache."""

    stages = ("final_window_commit",)

    def defective(self, stage, ctx, v):
        from layers.prefill import tables

        if tables.owner(ctx.case, ctx.case.num_segments - 1)[0] == ctx.rank:
            return stage.run(ctx, v)
        return {"kv_cache": v["kv_cache"]}


class PrefillDroppedKeys(StageDefect):
    """The reference's key tables: only the immediate predecessor's tail, so a segment shorter
    than the window drops the keys of the segments before it."""

    stages = ("key_table",)

    def defective(self, stage, ctx, v):
        from layers.prefill import tables

        rows = tables.key_rows(v["query_position_ids"], v["overlay_active_lengths"], v["predecessor_segments"],
                               v["segment_starts_t"], ctx.case.window, v["kv_cache"][..., 0, 0].numel(),
                               predecessors="first")
        return {"swa_key_rows": rows}


# -- layer=block: the hand-off from the attention half to the MoE half ---------------------------
class BlockRowsReordered(StageDefect):
    """The hand-off gives the MoE the rank's attention rows in reverse order, not in the order the
    reduce-scatter and hc_post left them."""

    stages = ("hand_off",)

    def defective(self, stage, ctx, v):
        return stage.run(ctx, {**v, "x_out": v["x_out"].flip(0)})


class BlockRowsOfAnotherGroup(StageDefect):
    """Rank r's MoE tokens are the attention rows of rank r + tp: the same place in the next TP
    group, whose requests they are not."""

    stages = ("hand_off",)

    def defective(self, stage, ctx, v):
        case = ctx.case
        every = wire.all_gather(v["x_out"].contiguous(), ctx.group, case.ep)
        return stage.run(ctx, {**v, "x_out": every[(ctx.rank + case.tp) % case.ep]})


class BlockResidualBeforeAttention(TorchTP):
    """The MoE's hc_post mixes the residual streams the attention started from (its input x_hc),
    not those its hc_post left (the rows handed to the MoE)."""

    def run_stage(self, stage, ctx, values):
        if ctx.case.layer != "moe" and stage.name == "hc_pre" and "x_hc" in values:
            self.attention_input = values["x_hc"]
        if ctx.case.layer == "moe" and stage.name == "hc_post":
            x_hc = values["x_hc"].clone()
            x_hc[: self.attention_input.shape[0]] = self.attention_input
            values = {**values, "x_hc": x_hc}
        return super().run_stage(stage, ctx, values)


class BlockDispatchesPaddedRows(TorchTP):
    """The MoE routes all T rows of the rank, the padding past the attention's local_t rows too."""

    def run_stage(self, stage, ctx, values):
        if ctx.case.layer == "moe" and "num_tokens" in values:
            values = {**values, "num_tokens": torch.tensor(ctx.case.tokens, dtype=torch.int32)}
        return super().run_stage(stage, ctx, values)


# -- context-parallel prefill: the CP exchanges of each layout ------------------------------------
class PrefillAllGatherRingOrder(StageDefect):
    """The contiguous layout's KV all-gather left in ring arrival order: rank r's block i holds
    rank (i + r) mod cp's rows, so every rank but 0 reads its keys from the wrong ranks."""

    stages = ("kv_allgather",)

    def defective(self, stage, ctx, v):
        hd = v["kv"].shape[-1]
        blocks = stage.run(ctx, v)["gathered_kv"].reshape(ctx.case.cp, -1, hd)
        return {"gathered_kv": torch.roll(blocks, -ctx.rank, dims=0).reshape(-1, hd)}


class PrefillTailsInRankMajorOrder(StageDefect):
    """The zigzag tail exchange never applies reverse_index: the tails stay in rank-major order
    (block 2·rank + part), which is the logical order only for the contiguous layout."""

    stages = ("tail_exchange",)

    def defective(self, stage, ctx, v):
        index = v["reverse_index"]
        return stage.run(ctx, {**v, "reverse_index": torch.arange(index.shape[-1], dtype=index.dtype).expand_as(index)})


# -- context-parallel prefill, HCA: the compressor's windows and the compact exchange --------------
class PrefillHCALocalRopePositions(PrefillLocalRopePositions):
    """HCA: RoPE of Q and KV at the rank-local row index (its position table is `query_positions`)."""

    def defective(self, stage, ctx, v):
        from types import SimpleNamespace

        renamed = SimpleNamespace(run=lambda c, vals: stage.run(c, {**vals, "query_positions": vals["query_position_ids"]}))
        return super().defective(renamed, ctx, {**v, "query_position_ids": v["query_positions"]})


class PrefillHCAWindowFromOwnRowsOnly(StageDefect):
    """HCA: a pooling window that straddles into earlier segments reads zeros there (no
    exchanged hidden tails), as if every block started in the segment that ends it."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        return stage.run(ctx, {**v, "logical_hidden_tails": torch.zeros_like(v["logical_hidden_tails"])})


class PrefillHCAWindowFromPredecessorOnly(StageDefect):
    """HCA: the reference's scratch pool: a pooling window reads the immediate predecessor's
    hidden tail only, so a window reaching two segments back reads zeros there."""

    stages = ("compressor",)

    def defective(self, stage, ctx, v):
        tails = v["logical_hidden_tails"]
        outs = []
        for part in range(2):
            pred = int(v["predecessor_segments"][part])
            kept = torch.zeros_like(tails)
            if pred >= 0:
                kept[pred] = tails[pred]
            outs.append(stage.run(ctx, {**v, "logical_hidden_tails": kept}))
        rows = outs[0]["local_cmp_payload"].shape[0] // 2  # part p's rows come from run p
        merged = {n: outs[0][n].clone() for n in outs[0]}
        for n in ("local_cmp_payload", "local_cmp_meta"):
            merged[n][rows:] = outs[1][n][rows:]
        final = int(v["final_segment_t"][0])
        if int(v["predecessor_segments"][1]) + 1 == final:
            for n in ("local_state_payload", "local_state_meta"):
                merged[n] = outs[1][n]
        return merged


class PrefillHCAStateOnOwnerOnly(StageDefect):
    """HCA: only the final segment's owner commits the last compressor-state rows."""

    stages = ("compact_exchange",)

    def defective(self, stage, ctx, v):
        from layers.prefill import tables

        before = v["compress_state"].clone()
        out = stage.run(ctx, v)
        if tables.owner(ctx.case, ctx.case.num_segments - 1)[0] != ctx.rank:
            out["compress_state"].copy_(before)
        return out


class PrefillHCACompressedRowsOnOwnerOnly(StageDefect):
    """HCA: each rank commits only the compressed rows it made itself (no compact exchange of them)."""

    stages = ("compact_exchange",)

    def defective(self, stage, ctx, v):
        from layers.prefill import hca

        out = stage.run(ctx, {**v, "local_cmp_meta": torch.full_like(v["local_cmp_meta"], -1)})  # no row sent
        no_state = (v["local_state_payload"][None][:0], v["local_state_meta"][None][:0])
        return hca.commit_compact({**v, **out}, v["local_cmp_payload"][None], v["local_cmp_meta"][None], *no_state,
                                  ctx.model.c128_state_block_size)
