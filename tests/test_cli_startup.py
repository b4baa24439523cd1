"""The command line answers at once: help, refusals and unknown names without PyTorch; a Ctrl-C
at any point of start-up prints one line and exits 130. Each case runs in a fresh interpreter
(a module once imported stays imported)."""

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

#: a fresh interpreter runs ``attnres ARGS`` in-process and says, on its last stderr line, the
#: exit code and whether PyTorch was imported
MAIN = """
import json, sys
from attnres.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit_:
    code = exit_.code
print(json.dumps({"code": code or 0, "torch": "torch" in sys.modules}), file=sys.stderr)
"""

SUBCOMMANDS = ("compare", "sweep", "train", "generate", "report", "convert", "export", "eval", "serve")
DESIGNS = r"\['block', 'delta', 'denseformer', 'full', 'gr', 'hc', 'mhar', 'mhc', 'prenorm'\]"


def fresh_cli(cwd, *args):
    """``attnres ARGS`` in a new interpreter, in folder ``cwd`` (the installed package is the one
    imported): its exit code, whether it imported PyTorch, and its output."""
    proc = subprocess.run([sys.executable, "-c", MAIN, *args], capture_output=True, text=True, timeout=120, cwd=cwd)
    *lines, last = proc.stderr.splitlines() or [""]
    result = json.loads(last) if last.startswith("{") else {"code": None, "torch": None}
    return result["code"], result["torch"], proc.stdout, "\n".join(lines)


@pytest.mark.parametrize("args,code,message", [
    (["--help"], 0, "Attention Residuals"),
    ([], 2, "usage: attnres"),
    *[([command, "--help"], 0, f"usage: attnres {command}") for command in SUBCOMMANDS],
    (["compare", "--seeds", "x"], 2, "argument --seeds: invalid int value: 'x'"),
    (["train", "--no-such-option"], 2, "unrecognized arguments: --no-such-option"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["generate"], 2, "the following arguments are required: run_dir"),
    (["convert", "--help"], 0, r"\(Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen3-MoE\)\s+to\s+Delta\s+AttnRes"),
    (["convert", "a", "b", "--block-layers", "2,x"], 2, "'2,x' is not a number or a comma list of numbers"),
    (["train", "--preset", "huge"], 2, r"unknown preset 'huge'; expected one of \['ablations', 'demo', 'regime', 'small'"),
    (["compare", "--preset", "huge", "--designs", "full"], 2, "unknown preset 'huge'"),
    (["compare", "--designs", "prenorm", "fulll"], 2, rf"design 'fulll': unknown design 'fulll'; expected one of {DESIGNS}"),
    (["compare", "--designs", "fulll:norm_eps=1e-12"], 2, "unknown design 'fulll'"),
    (["compare", "--baseline", "blok"], 2, "unknown design 'blok'"),
    (["report", "runs/x", "--baseline", "nope"], 2, "unknown design 'nope'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_help_refusals_and_unknown_names_need_no_pytorch(tmp_path, args, code, message):
    got, torch_loaded, out, err = fresh_cli(tmp_path, *args)
    assert got == code, out + err
    assert re.search(message, out + err), out + err
    assert torch_loaded is False, f"attnres {' '.join(args)} imported PyTorch"


def test_the_package_loads_its_names_on_first_use(tmp_path):
    """``import attnres`` imports no PyTorch; every name it exported when it imported them all
    still comes from it, the same object as its module's, and ``dir`` lists them."""
    exported = ["ExpertStats", "KINDS", "KVCache", "ModelConfig", "MoE", "Stream", "Trace", "Transformer",
                "build_stream", "depth_attention", "param_groups"]
    check = f"""
import sys
import attnres
assert "torch" not in sys.modules, "import attnres imported PyTorch"
assert sorted(attnres.__all__) == {sorted(exported)!r}, attnres.__all__
assert set(attnres.__all__) <= set(dir(attnres))
from attnres import Transformer
from attnres.model import Transformer as defined, ModelConfig, KVCache
from attnres.ops import depth_attention
assert Transformer is defined and attnres.ModelConfig is ModelConfig and attnres.KVCache is KVCache
assert attnres.depth_attention is depth_attention and callable(depth_attention)
for name in attnres.__all__:
    getattr(attnres, name)
try:
    attnres.no_such_name
except AttributeError as exc:
    assert "no_such_name" in str(exc)
else:
    raise AssertionError("attnres.no_such_name did not raise AttributeError")
"""
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_the_commands_act_on_the_names_the_parser_offers():
    """One list of each: the comparison's designs and the presets are those of ``attnres.names``,
    every preset is made, and every comparison preset's design is a design's label."""
    from attnres import names
    from attnres.experiments import designs
    from attnres.train import config

    assert designs.DESIGNS is names.DESIGNS and designs.DEFAULT_DESIGNS is names.DEFAULT_DESIGNS
    assert tuple(config.PRESETS) == names.PRESET_NAMES
    assert all(isinstance(config.preset(name), config.TrainConfig) for name in names.PRESET_NAMES)
    assert set(names.COMPARISON_PRESETS) <= set(names.PRESET_NAMES)
    for chosen in names.COMPARISON_PRESETS.values():
        assert [designs.parse_design(label)[0] for label in chosen["designs"]]
    assert designs.comparison_choice("ablations")[0] == list(names.ABLATIONS)


def first_line(stream, timeout: float) -> str:
    """The first line of ``stream``, or '' when none comes within ``timeout`` seconds."""
    lines = queue.Queue()
    threading.Thread(target=lambda: lines.put(stream.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        return ""


def torch_is_loaded(pid: int) -> bool | None:
    """Whether process ``pid`` has PyTorch's library mapped (Linux's /proc), None elsewhere."""
    maps = Path(f"/proc/{pid}/maps")
    return "libtorch" in maps.read_text() if maps.exists() else None


@contextlib.contextmanager
def as_a_terminal_starts_it():
    """SIGINT and SIGTERM as a shell in a terminal leaves them to the command it starts: neither
    ignored nor blocked. A test worker's own state (an xdist worker may hold either) would
    otherwise pass to the child, whose Ctrl-C then never arrives."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, previous)


#: each point of start-up (``cli.PAUSE_POINTS``), whether PyTorch is loaded there, and the line a
#: Ctrl-C there prints
POINTS = [("start", False, "attnres: interrupted"), ("parsed", False, "attnres: interrupted"),
          ("loaded", True, "attnres: interrupted"), ("running", True, "attnres train: interrupted")]


def test_ctrl_c_reaches_a_command_started_with_its_signals_blocked(tmp_path):
    """A parent that holds SIGINT and SIGTERM blocked while it starts ``attnres`` passes that
    mask on; the command unblocks them, so a Ctrl-C while it starts still ends it with one line."""
    held = {signal.SIGINT, signal.SIGTERM}
    with as_a_terminal_starts_it():  # SIGINT not ignored (a worker started in the background ignores it)
        before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "attnres", "train", "--preset", "tiny", "--run-dir",
                                     str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, cwd=tmp_path, env={**os.environ, "ATTNRES_PAUSE_AT": "start"})
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
    try:
        assert first_line(proc.stderr, timeout=120) == "attnres: paused at start\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert (proc.returncode, err, out) == (130, "attnres: interrupted\n", "")


@pytest.mark.parametrize("point,torch_loaded,line", POINTS, ids=[p[0] for p in POINTS])
def test_ctrl_c_while_starting_prints_one_line_and_exits_130(tmp_path, point, torch_loaded, line):
    """``attnres train`` stopped at a point of its start-up (``ATTNRES_PAUSE_AT``), then sent
    SIGINT: one line on stderr, exit status 130, no run folder; before PyTorch loads and after
    (the trainer's modules imported), as the command starts to run too."""
    run_dir = tmp_path / "run"
    with as_a_terminal_starts_it():
        proc = subprocess.Popen([sys.executable, "-m", "attnres", "train", "--preset", "tiny", "--run-dir",
                                 str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=tmp_path, env={**os.environ, "ATTNRES_PAUSE_AT": point})
    try:
        marker = first_line(proc.stderr, timeout=120)
        assert marker == f"attnres: paused at {point}\n", marker
        assert torch_is_loaded(proc.pid) in (torch_loaded, None)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert (proc.returncode, err, out) == (130, line + "\n", "")
    assert not run_dir.exists()
