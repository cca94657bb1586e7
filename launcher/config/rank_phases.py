"""The phases every rank runs, in order: the one list of their names.

A rank's run (`launcher.run.worker`) is fixture -> [golden] -> [save] -> layer -> gather ->
[bench] -> [compare] -> [bisect]. These names are the keys of result.json's `rank_seconds`, the
`phase` of a rank's progress events and of a failure report (`stage` in a result of
schema_version 1), the values `fault.phase` accepts, and the cells of the console's phases line,
in this order.

"Stage" alone means a layer's spec stages (`layers.stages`: hc_pre, rms_norm, ..., hc_post),
which bisect walks inside the rank phase "bisect".
"""

from __future__ import annotations

RANK_PHASES = ("fixture", "golden", "save", "layer", "gather", "bench", "compare", "bisect")
# Where a fault may be placed: not in bisect, which runs only after a comparison failed, so a
# smoke test's fault there would never fire on a passing run.
FAULT_PHASES = RANK_PHASES[:-1]
