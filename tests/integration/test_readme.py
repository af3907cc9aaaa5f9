"""README.md is the contract: its commands run as written, in the order a newcomer meets them.

The fenced blocks are read from README.md, then from the pages under docs/ it links to that
hold commands (`PAGES`, in the order a newcomer reads them), when the test runs, so the pages
and this test cannot drift apart. Every ```bash and ```python block of every page of `PAGES`
runs, unless the line just before it says why it cannot here (`<!-- not run by tests: needs 8
GPUs -->`); a block with neither fails the first test, so a new block cannot go untested
silently. Output is fenced as ```text, config as ```yaml (each must load as YAML; a `ckpt:`
section as a `CkptConfig`).

The runnable blocks of all the pages run in one fresh `bash` (no profile, no rc file, the venv
not active, no launcher or DELTAREC_* variables), one after the other as a user pastes them, so
what one block sets up (the venv it activates, `$BROKER`, `job.yaml`, a background follower's
`$!`) is there for the next, a page's first block running after the last of the page before
it. Its working directory is a temporary one holding links to the read-only parts of the
checkout the commands name (`.venv`, `configs/`, `examples/`, `launch/`), so `runs/`, `job.yaml`
and `model.pt` land there and never in the checkout. A python block runs as `python FILE` in that
shell, followed by checks of what it left (the export recipe: every tensor loaded). The whole
run is bounded (`RUN_TIMEOUT_S`); each long-running command a page starts in the background
is stopped by the page itself (`kill $!`), and whatever is left is killed by process group,
the broker by `deltarec-broker stop`, and counted as the pages' fault.

After the run, what the pages say the commands do is checked where it is cheap: the run
directory a user's own loop leaves (`runs/two_tower/ckpt.yaml`) is listed from another
directory, the server answered a prediction, the partial recovery happened, the follower and
the server stopped cleanly, TensorBoard has events.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from launch.ranks import REPO
from tests.conftest import LAUNCHER_VARS

pytestmark = pytest.mark.integration

README = REPO / "README.md"
# The pages whose commands run, README.md first and then those it links to that hold commands,
# in the order a newcomer reads them: a page's commands may use what the pages before it set up
# (the venv, `$BROKER`, `job.yaml`, the runs so far), and docs/production.md stops the broker last.
PAGES = (
    "README.md",
    "docs/own-loop.md",
    "docs/checkpoints.md",
    "docs/production.md",
    "docs/gpu.md",
    "docs/multinode.md",
)
RUN = ("bash", "python")  # what a user runs
NOT_RUN = ("text", "yaml")  # what a user reads (output) or writes into a file (config)
SKIP = re.compile(r"<!--\s*not run by tests:\s*(?P<why>\S.*?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
# the parts of the checkout the pages' commands name, linked into the working directory (read-only use)
LINKED = (".venv", "configs", "examples", "launch")
RUN_TIMEOUT_S = 420  # every page of PAGES; about 2.5 minutes on 2 idle cores
SERVE_PORT = 8470  # README's `curl localhost:8470`: the server's default port


@dataclass(frozen=True)
class Block:
    """One fenced block of a page of `PAGES`."""

    page: str  # the page, relative to the checkout (`README.md`, `docs/own-loop.md`)
    line: int  # the page's line of its opening fence (1-based)
    lang: str
    code: str
    heading: str  # the section it stands in
    skip: str | None  # why it is not run (the marker just before it), or None

    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.heading})"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """Every fenced block, in order, with its section heading and its `not run by tests` marker."""
    lines = text.splitlines()
    blocks: list[Block] = []
    heading = ""
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            if re.match(r"#{1,6} ", lines[i]):
                heading = lines[i].lstrip("#").strip()
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a ``` block that never closes"
        before = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        skip = SKIP.fullmatch(before)
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(page, i + 1, fence["lang"], code, heading, skip["why"] if skip else None))
        i = end + 1
    return blocks


def page_blocks() -> list[Block]:
    """Every fenced block of every page of `PAGES`, in order."""
    return [b for page in PAGES for b in readme_blocks((REPO / page).read_text(), page)]


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.lang in RUN and b.skip is None]


# --- what the pages may hold ------------------------------------------------------------------


def test_every_page_is_linked_from_the_readme_and_holds_commands() -> None:
    readme = README.read_text()
    assert PAGES[0] == "README.md"
    for page in PAGES[1:]:
        assert f"]({page})" in readme, f"{page} holds commands the test runs, but README.md links to it nowhere"
        langs = {b.lang for b in readme_blocks((REPO / page).read_text(), page)}
        assert langs & set(RUN), f"{page} holds no command block: take it off PAGES"


def test_every_block_runs_or_says_why_not(tmp_path: Path) -> None:
    for page in PAGES:
        _check_page(page, tmp_path)
    run = runnable(page_blocks())
    assert run and run[0].code.strip() == "source .venv/bin/activate" and run[0].page == "README.md", (
        "the first command a newcomer runs after the quick start activates the venv: the bare command names need it"
    )


def _check_page(page: str, tmp_path: Path) -> None:
    text = (REPO / page).read_text()
    blocks = readme_blocks(text, page)
    unknown = [f"{b.where()}: ```{b.lang}" for b in blocks if b.lang not in (*RUN, *NOT_RUN)]
    assert not unknown, (
        f"blocks fenced with a language this test does not know: {unknown}; fence commands as bash "
        "or python (run, or marked `<!-- not run by tests: why -->`), output as text, config as yaml"
    )
    misplaced = [b.where() for b in blocks if b.skip is not None and b.lang not in RUN]
    assert not misplaced, f"a `not run by tests` marker before a block that is never run anyway: {misplaced}"
    markers = len(SKIP.findall(text))
    assert text.count("<!-- not run") == markers, f"{page}: a `not run` comment not in the form `<!-- not run by tests: why -->`"
    assert markers == sum(b.skip is not None for b in blocks), f"{page}: a `not run by tests` marker that stands before no block"
    # config a user writes into a file must load: as YAML, and a `ckpt:` section as deltarec reads it
    from ckpt.config import load_ckpt_config

    for b in blocks:
        if b.lang == "yaml":
            data = yaml.safe_load(b.code)
            assert isinstance(data, dict), b.where()
            if "ckpt" in data:
                path = tmp_path / f"{Path(page).stem}-block{b.line}.yaml"
                path.write_text(b.code)
                load_ckpt_config(path).resolved("readme", tmp_path).validate(b.where())


# --- running it -------------------------------------------------------------------------------

# A python block runs as `python FILE` (the venv's, once the README activated it), then this
# checks what it left: an exported model loaded into a fresh one must hold the export's tensors.
PYTHON_RUNNER = """\
import runpy
import sys

import torch

ns = runpy.run_path(sys.argv[1], run_name="__main__")
model = ns.get("model")
if isinstance(model, torch.nn.Module) and "model.pt" in open(sys.argv[1]).read():
    exported = torch.load("model.pt")["model"]
    state = model.state_dict()
    assert set(state) == set(exported), sorted(set(state) ^ set(exported))
    for fqn, value in exported.items():
        assert state[fqn].device.type != "meta", f"{fqn}: left on the meta device, nothing loaded"
        assert torch.equal(state[fqn], value), f"{fqn}: not the exported tensor"
    print(f"readme-test: checked: the export loaded into the fresh model ({len(exported)} tensors equal)")
"""


def _driver(blocks: list[Block], tmp: Path) -> Path:
    """One bash script that runs `blocks` in order in one shell, as a user pastes them: stops at
    the first command that fails, naming its page and line; `done INDEX` (the block's place in
    `blocks`) in the progress file after each block."""
    code = tmp / "blocks"
    code.mkdir()
    (code / "run_python_block.py").write_text(PYTHON_RUNNER)
    progress = tmp / "progress"
    out = [
        "set -eE -o pipefail",
        f"READMETEST_PROGRESS={shlex.quote(str(progress))}",
        "trap 'echo \"readme-test: $READMETEST_PAGE:$((READMETEST_LINE + LINENO)) failed (exit $?): $BASH_COMMAND\" >&2' ERR",
    ]
    for index, b in enumerate(blocks):
        path = code / f"{index:03d}-{Path(b.page).stem}-{b.line:05d}.{'sh' if b.lang == 'bash' else 'py'}"
        path.write_text(b.code)
        out += [
            f"echo {shlex.quote(f'readme-test: running {b.where()}')} >&2",
            f"READMETEST_PAGE={shlex.quote(b.page)}",
            f"READMETEST_LINE={b.line}",
        ]
        if b.lang == "bash":
            out.append(f"source {shlex.quote(str(path))}")
        else:  # its traceback names the block's file: line N there is the page's line `b.line + N`
            run = f"python {shlex.quote(str(code / 'run_python_block.py'))} {shlex.quote(str(path))}"
            failed = shlex.quote(f"readme-test: the python block at {b.where()} failed")
            out.append(f"{run} || {{ echo {failed} >&2; exit 1; }}")
        out.append(f'echo "done {index}" >> "$READMETEST_PROGRESS"')
    driver = tmp / "readme.sh"
    driver.write_text("\n".join(out) + "\n")
    return driver


def _fresh_env() -> dict[str, str]:
    """This environment as a new terminal has it: no venv active, no launcher's or test's variables."""
    venv_bin = {str(REPO / ".venv" / "bin"), os.path.realpath(REPO / ".venv" / "bin")}
    drop = {*LAUNCHER_VARS, "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("DELTAREC_", "PYTEST_", "SLURM_", "TORCHELASTIC_"))
    }
    path = [p for p in env.get("PATH", "/usr/bin:/bin").split(":") if p and os.path.realpath(p) not in venv_bin]
    env["PATH"] = ":".join(path)
    return env


def _group_left(pgid: int) -> list[str]:
    """The live processes of process group `pgid` (zombies aside), as `pid command`."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            left.append(f"{stat.parent.name} {cmd}")
    return left


def _stop_group(pgid: int) -> list[str]:
    """SIGTERM, then SIGKILL, every process still in the group; what was left running."""
    left = _group_left(pgid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_left(pgid):
            break
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 10
        while _group_left(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
    return left


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_readme_runs_as_written(tmp_path: Path) -> None:
    blocks = runnable(page_blocks())
    work = tmp_path / "work"
    work.mkdir()
    for name in LINKED:
        assert (REPO / name).exists(), f"{REPO / name} is missing: run launch/setup.sh"
        (work / name).symlink_to(REPO / name)
    if not _port_free(SERVE_PORT):
        pytest.fail(f"port {SERVE_PORT} on 127.0.0.1 is taken: README's `deltarec-serve` needs it", pytrace=False)
    driver = _driver(blocks, tmp_path)
    log_path = tmp_path / "readme.log"
    started = time.monotonic()
    with open(log_path, "w") as out:
        shell = subprocess.Popen(
            ["bash", "--noprofile", "--norc", str(driver)],
            cwd=work,
            env=_fresh_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: whatever it leaves behind is found and stopped
        )
        try:
            rc = shell.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            left = _stop_group(shell.pid)
            shell.wait(timeout=30)
            subprocess.run(
                [sys.executable, "-m", "launch.broker", "stop", "--state-dir", str(work / "runs" / "broker")],
                cwd=work,
                capture_output=True,
                timeout=60,
            )
    elapsed = time.monotonic() - started
    log = log_path.read_text(errors="replace")
    done = set((tmp_path / "progress").read_text().split()) if (tmp_path / "progress").exists() else set()
    missing = [b for i, b in enumerate(blocks) if str(i) not in done]
    stuck = missing[0].where() if missing else "after the last block"
    if rc is None:
        pytest.fail(f"the pages' commands did not finish within {RUN_TIMEOUT_S} s: at {stuck}\n{log[-8000:]}", pytrace=False)
    if rc != 0 or missing:
        pytest.fail(
            f"the pages' commands stopped (exit {rc}) at {stuck}\n--- the shell's output, its end ---\n{log[-8000:]}",
            pytrace=False,
        )
    assert not left, f"the pages leave processes running after their last command: {left}"
    print(f"{', '.join(PAGES)}: {len(blocks)} blocks ran in {elapsed:.0f} s")

    # What the pages say they do, where it is cheap to see.
    assert "readme-test: checked: the export loaded into the fresh model" in log, log[-4000:]
    assert '{"scores": [' in log, "the server answered no prediction"
    assert "partial recovery: ranks [0] of 2 kept step" in log, "the partial recovery section recovered nothing"
    runs = work / "runs"
    for name in ("follower.log", "serve.log"):
        text = (runs / name).read_text()
        assert "Traceback" not in text and "stopped" in text.splitlines()[-1], f"{name}: not a clean stop\n{text[-3000:]}"
    assert list((runs / "job" / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    # A user's own loop leaves <run_dir>/ckpt.yaml with absolute paths: it works from any directory.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    listing = subprocess.run(
        [str(REPO / ".venv" / "bin" / "deltarec-ckpt"), "--config", str(runs / "two_tower" / "ckpt.yaml"), "list"],
        cwd=elsewhere,
        env=_fresh_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listing.returncode == 0 and re.search(r"^\s+\d+\s+\d+\s+full\b.*complete$", listing.stdout, re.M), (
        f"deltarec-ckpt list of runs/two_tower from another directory:\n{listing.stdout}\n{listing.stderr[-2000:]}"
    )
    assert not list(elsewhere.iterdir()), f"deltarec-ckpt list wrote into the directory it ran in: {list(elsewhere.iterdir())}"
