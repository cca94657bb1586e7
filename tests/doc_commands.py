"""The shell commands of the README and of docs/: every line of their ```bash blocks, parsed and
classified by how a test can check it.

Kinds: `run` (tiny dims, a snapshot made just before, a listing or comparison of earlier output,
`--help`, `--cfg`: run as written), `compose` (flash dims, a cluster, a placeholder
implementation: composed with `--cfg`, never run), `pytest` (collected, not run: the suite would
run itself), `install` (pip: the extras it names must exist) and `system` (apt-get: the packages
CI installs). A command's expected exit status is 0, `(exit N)` in its comment, or 1 where the
comment says FAIL. A line that fits no kind makes the doc test fail: a new command must be one a
test can check.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Commands that only prefix the one they start (`srun ... python -m launcher ...`).
_WRAPPERS = ("srun", "/usr/bin/time", "timeout", "torchrun")
_LAUNCHER = ("launcher", "launcher.torchrun")


@dataclass(frozen=True)
class Command:
    source: str            # "docs/sweeps.md:42"
    text: str              # the command as written (continuations joined), its comment removed
    comment: str
    kind: str              # run | compose | pytest | script | install | system | unknown
    expected: int          # the exit status the doc states

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    def launcher_args(self) -> list[str] | None:
        """The overrides after `python -m launcher` (or its torchrun worker), wrappers skipped;
        None for any other command."""
        argv = self.argv
        for i in range(len(argv) - 2):
            if argv[i].startswith("python") and argv[i + 1] == "-m" and argv[i + 2] in _LAUNCHER:
                return [a for a in argv[i + 3:] if a not in (">",)]
        if argv and argv[0] == "dsv4-tp-harness":
            return argv[1:]
        return None


def _split_comment(line: str) -> tuple[str, str]:
    """The line before its first unquoted ` #`, and the comment after it."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def _bash_lines(path: Path):
    """(line number, logical line) of every ```bash block, continuations joined."""
    inside, pending, start = False, "", 0
    for num, raw in enumerate(path.read_text().splitlines(), 1):
        if raw.startswith("```"):
            inside = raw.strip() == "```bash"
            continue
        if not inside:
            continue
        if not pending:
            start = num
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1].rstrip() + " "
            continue
        yield start, pending + raw.strip() if pending else raw.strip()
        pending = ""


def _expected(comment: str) -> int:
    explicit = re.search(r"\(exit (\d)\)", comment)
    if explicit:
        return int(explicit.group(1))
    return 1 if "FAIL" in comment else 0


def classify(text: str) -> str:
    argv = shlex.split(text)
    if not argv:
        return "unknown"
    if argv[0] == "pip":
        return "install"
    if argv[0] == "apt-get":
        return "system"
    if argv[:3] == ["python", "-m", "pytest"]:
        return "pytest"
    if argv[0] == "python" and len(argv) > 1 and argv[1].startswith("scripts/"):
        return "script"  # a measurement: minutes of work, checked against its own --help
    if argv[:2] == ["python", "-m"] and argv[2].startswith("launcher.") and argv[2] != "launcher.torchrun":
        return "run"  # the housekeeping tools: list, rerun, compare, cache
    args = Command("", text, "", "", 0).launcher_args()
    if args is None:
        return "unknown"
    if any(a in ("--help", "-h", "--cfg", "-c") for a in args):
        return "run"
    cluster = argv[0] in _WRAPPERS and argv[0] != "/usr/bin/time" or any(
        re.fullmatch(r"nnodes=([2-9]|\d\d+)", a) or a.startswith(("master_addr=", "hydra/launcher=slurm")) for a in args)
    placeholder = any("my_kernels." in a for a in args)
    small = any(a in ("model=tiny", "+sweep=smoke") or a.startswith("golden_data=") for a in args)
    return "run" if small and not cluster and not placeholder else "compose"


def doc_commands(path: Path) -> list[Command]:
    """Every command of one doc file, in order; `a && b` gives two."""
    out = []
    for num, line in _bash_lines(path):
        text, comment = _split_comment(line)
        if not text:
            continue
        for part in (p.strip() for p in text.split(" && ")):
            out.append(Command(f"{path.relative_to(REPO)}:{num}", part, comment, classify(part), _expected(comment)))
    return out


def all_commands() -> list[Command]:
    return [c for path in DOC_FILES for c in doc_commands(path)]


def cfg_flag(args: list[str]) -> list[str]:
    """What shows a command's composed config without running it: Hydra's node where the
    command chooses a Hydra group (a launcher), else the job's."""
    return ["--cfg", "hydra" if any(a.startswith("hydra/") for a in args) else "job"]
