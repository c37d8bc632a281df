"""The fx16 command, run as a user runs it: its exit codes, stdout and stderr (in this
process where it needs no working directory or environment of its own; the console
script, a pipe and the start-up without torch in a subprocess)."""

import hashlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

from helpers import CHECKOUT, export, run_fx16, with_checkout
from models import MLP, ScaleShiftChain


def fx16(*args, cwd=None, path=None):
    """Run the command; ``path``: a folder to put on PYTHONPATH (before the checkout under
    test, which ``run_fx16`` puts there)."""
    env = {**os.environ, "PYTHONPATH": str(path)} if path is not None else None
    return run_fx16(args, cwd=cwd, env=env)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """An MLP saved as .pt2, and a file of calibration inputs."""
    folder = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    path = folder / "mlp.pt2"
    torch.export.save(export(MLP(), torch.randn(4, 8)), path)
    inputs = folder / "inputs.pt"
    torch.save([(torch.randn(4, 8),) for _ in range(3)], inputs)
    return path, inputs


def test_cast_writes_a_loadable_fp16_program_and_a_summary(program, tmp_path):
    source, _ = program
    before = _digest(source)
    target = tmp_path / "mlp16.pt2"
    result = fx16("cast", source, "-o", target, "--report", tmp_path / "report.json")
    assert result.returncode == 0, result.stderr
    assert "weight bytes:" in result.stdout and "(0.50x)" in result.stdout
    assert "max relative error vs fp32:" in result.stdout
    loaded = torch.export.load(target)
    assert {t.dtype for t in loaded.state_dict.values()} == {torch.float16}
    assert loaded.module()(torch.randn(4, 8).half()).dtype == torch.float16
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["totals"]["weight_bytes_after"] * 2 == report["totals"]["weight_bytes_before"]
    assert _digest(source) == before


def test_dry_run_writes_nothing(program, tmp_path):
    source, _ = program
    result = fx16(
        "cast", source, "-o", tmp_path / "out.pt2", "--dry-run", "--policy", "auto_mixed_bf16"
    )
    assert result.returncode == 0, result.stderr
    assert "bfloat16" in result.stdout
    assert not (tmp_path / "out.pt2").exists()


@pytest.mark.parametrize(
    "setting, rule",
    [
        (("--explicit-fp32", "keep"), "explicit_fp32"),
        (("--explicit-fp32", "retarget"), None),
        (("--target", "neural_engine"), None),
        (("--target", "neural_engine", "--explicit-fp32", "keep"), "explicit_fp32"),
    ],
)
def test_explicit_fp32_setting(tmp_path, setting, rule):
    """--explicit-fp32 and --target reach the policy: an RMSNorm's fp32 region kept, or
    made fp16 (the Neural Engine's setting, where the region's values fit); an explicit
    setting wins over the target's."""
    from models import RMSNormMLP

    source = tmp_path / "norm.pt2"
    torch.export.save(export(RMSNormMLP(), torch.randn(3, 16)), source)
    report = tmp_path / "report.json"
    result = fx16("cast", source, "-o", tmp_path / "out.pt2", *setting, "--report", report)
    assert result.returncode == 0, result.stderr
    rules = {row["rule"] for row in json.loads(report.read_text())["nodes"]}
    assert (rule in rules) if rule else not rules & {"explicit_fp32"}


def test_calibration_file_and_accuracy_budget(program, tmp_path):
    source, inputs = program
    result = fx16(
        "cast",
        source,
        "-o",
        tmp_path / "out.pt2",
        "--calibrate",
        inputs,
        "--max-rel-error",
        "0.05",
        "--keep-io-types",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == ""  # --quiet: no summary, no progress
    loaded = torch.export.load(tmp_path / "out.pt2")
    assert loaded.module()(torch.randn(4, 8)).dtype == torch.float32  # io types kept


def test_inspect_explains_without_writing(program, tmp_path):
    source, _ = program
    result = fx16("inspect", source, "--all", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    header = ["node", "module", "op", "dtype", "rule", "fp32-cost", "why"]
    assert result.stdout.splitlines()[0].split() == header
    assert "float ops in 16-bit" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_reader_that_stops_early_is_not_an_error(tmp_path):
    """``fx16 inspect X.pt2 --all | head -1``: no BrokenPipeError traceback."""
    source = tmp_path / "chain.pt2"
    long_chain = ScaleShiftChain(300, 1.001, 0.1)  # inspect's table outgrows a pipe's buffer
    torch.export.save(export(long_chain, torch.randn(2, 4)), source)
    command = f"{sys.executable} -m fx16 inspect {source} --all | head -1"
    result = subprocess.run(
        command,
        shell=True,
        capture_output=True,
        text=True,
        timeout=300,
        env=with_checkout(None),
    )
    assert result.stdout.split()[:3] == ["layer", "FLOPs", "16-bit"]  # the per-layer summary first
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_compare_shows_both_dtypes(program, tmp_path):
    source, inputs = program
    target = tmp_path / "mlp16.pt2"
    assert fx16("cast", source, "-o", target, "--quiet").returncode == 0
    result = fx16("compare", source, target, "--inputs", inputs)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split()[:2] == ["input", "output"]
    assert len(rows) == 3 and all("float32    float16" in row for row in rows)
    assert [row.split()[0] for row in rows] == ["0", "1", "2"]  # one row per input
    # --max-rel-error: a check for CI, exit 3 over the threshold
    tight = fx16("compare", source, target, "--inputs", inputs, "--max-rel-error", "1e-7")
    loose = fx16("compare", source, target, "--inputs", inputs, "--max-rel-error", "1e-2")
    assert tight.returncode == 3 and "more than --max-rel-error 1e-07" in tight.stderr
    assert loose.returncode == 0, loose.stderr


class LogRelu(torch.nn.Module):
    """log(relu(x) + eps): -inf wherever x <= 0 for eps 0, finite for eps 1e-30."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return torch.log(torch.relu(x) + self.eps)


def test_compare_flags_a_non_finite_value_the_other_program_does_not_reproduce(tmp_path):
    """A holds -inf where B is finite: the row is flagged, a line says so, and with
    --max-rel-error the exit code is 3 (once: exit 0, "max |A-B| inf" beside a small
    relative error). The same program on both sides matches its own -inf."""
    x = torch.tensor([[-1.0, 2.0, 3.0, 4.0]])
    first, second = tmp_path / "a.pt2", tmp_path / "b.pt2"
    torch.export.save(export(LogRelu(0.0), x), first)
    torch.export.save(export(LogRelu(1e-30), x), second)  # the same, but finite at -1
    result = fx16("compare", first, second, "--max-rel-error", "0.5")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "(!) input 0 output 0: A holds 1 inf or NaN value(s) that B does not reproduce" in (
        result.stdout
    )
    assert "hold inf or NaN that B does not reproduce" in result.stderr
    same = fx16("compare", first, first, "--max-rel-error", "0.5")
    assert same.returncode == 0 and "(!)" not in same.stdout


def test_cast_takes_overflow_margin_and_q(program, tmp_path):
    """--overflow-margin reaches the API (the report's options) and -q silences the
    summary, as --quiet does."""
    source, _ = program
    report = tmp_path / "r.json"
    result = fx16(
        "cast", source, "-o", tmp_path / "x.pt2", "-q", "--overflow-margin", "8", "--report", report
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert json.loads(report.read_text())["provenance"]["options"]["overflow_margin"] == 8.0


def test_a_half_program_is_cast_to_bf16_as_the_api_casts_it(tmp_path):
    """The command once refused every 16-bit program; like the API, it converts one of
    the other dtype."""
    torch.manual_seed(0)
    source, target = tmp_path / "half.pt2", tmp_path / "bf16.pt2"
    torch.export.save(export(MLP().half(), torch.randn(4, 8).half()), source)
    result = fx16("cast", source, "-o", target, "--policy", "auto_mixed_bf16")
    assert result.returncode == 0, result.stderr
    loaded = torch.export.load(target)
    assert {t.dtype for t in loaded.state_dict.values()} == {torch.bfloat16}


def test_cast_and_inspect_print_the_same_summary(program, tmp_path):
    source, _ = program
    cast = fx16("cast", source, "-o", tmp_path / "x.pt2", "--dry-run")
    inspect = fx16("inspect", source)
    assert cast.returncode == inspect.returncode == 0
    summary = [line for line in cast.stdout.splitlines() if not line.startswith("wrote")]
    assert inspect.stdout.splitlines()[-len(summary) :] == summary


def _damaged_copy(source, target):
    """``source`` with one byte of its first weight flipped: a valid zip, a bad CRC."""
    with zipfile.ZipFile(source) as archive:
        entry = next(i for i in archive.infolist() if "/weights/" in i.filename and i.file_size)
    data = bytearray(source.read_bytes())
    # the local header's name and extra lengths (torch pads the extra field to align data)
    name_length, extra_length = struct.unpack_from("<HH", data, entry.header_offset + 26)
    data[entry.header_offset + 30 + name_length + extra_length] ^= 0xFF
    target.write_bytes(bytes(data))


def _bad_inputs(folder, source):
    (folder / "notes.txt").write_text("not a program")
    with zipfile.ZipFile(folder / "corrupt.pt2", "w") as archive:
        archive.writestr("corrupt/data.pkl", b"junk")
    _damaged_copy(source, folder / "damaged.pt2")
    torch.save([(torch.randn(3, 5),)], folder / "wrong_shape.pt")
    (folder / "text.pt").write_text("x = 1\n")
    torch.export.save(export(MLP(widths=(6, 4)), torch.randn(4, 6)), folder / "other.pt2")
    half = export(MLP().half(), torch.randn(4, 8).half())
    torch.export.save(half, folder / "half.pt2")
    torch.save([], folder / "empty.pt")
    (folder / "out_dir").mkdir()
    return {
        "output is a directory": (["cast", source, "-o", folder / "out_dir"], "is a directory"),
        "output is a device": (["cast", source, "-o", "/dev/full"], "not a regular file"),
        "output cannot be written": (
            ["cast", source, "-o", "/proc/fx16_out.pt2"],
            "cannot be written",
        ),
        "negative threshold": (
            ["compare", source, source, "--per-node", "--threshold", "-5"],
            "--threshold must be a finite number >= 0",
        ),
        "options before the program": (
            ["cast", folder / "corrupt.pt2", "-o", folder / "x.pt2", "--policy", "bogus"],
            "unknown policy 'bogus'",
        ),
        "empty calibration": (
            ["cast", source, "-o", folder / "x.pt2", "--calibrate", folder / "empty.pt"],
            "empty list",
        ),
        "16-bit program": (
            ["cast", folder / "half.pt2", "-o", folder / "x.pt2"],
            "computes in float16 already",
        ),
        "missing": (["cast", folder / "missing.pt2", "-o", folder / "x.pt2"], "does not exist"),
        "not a pt2": (["cast", folder / "notes.txt", "-o", folder / "x.pt2"], "not a .pt2"),
        "corrupt": (["cast", folder / "corrupt.pt2", "-o", folder / "x.pt2"], "cannot load"),
        "overwrite": (["cast", source, "-o", source], "--force"),
        "policy": (
            ["cast", source, "-o", folder / "x.pt2", "--policy", "fastest"],
            "unknown policy",
        ),
        "directory": (["cast", source, "-o", folder / "no" / "x.pt2"], "does not exist"),
        "damaged entry": (
            ["cast", folder / "damaged.pt2", "-o", folder / "x.pt2"],
            "does not match its data",
        ),
        "wrong-shape inputs": (
            ["cast", source, "-o", folder / "x.pt2", "--calibrate", folder / "wrong_shape.pt"],
            "has shape (3, 5); the program takes (4, 8)",
        ),
        "not a tensor file": (
            ["cast", source, "-o", folder / "x.pt2", "--calibrate", folder / "text.pt"],
            "expected a list of input tuples saved with torch.save",
        ),
        "compare different inputs": (
            ["compare", source, folder / "other.pt2"],
            "other.pt2's inputs[0]: input 'x' has shape (4, 8); the program takes (4, 6)",
        ),
        "unknown import": (
            ["inspect", source, "--import", "no_such_module_here"],
            "cannot import no_such_module_here",
        ),
        # every output path is checked before the program loads (a corrupt one here)
        "html is a directory": (
            ["inspect", folder / "corrupt.pt2", "--html", folder / "out_dir"],
            "--html " + str(folder / "out_dir") + " is a directory",
        ),
        "html cannot be written": (
            ["inspect", folder / "corrupt.pt2", "--html", "/proc/fx16.html"],
            "--html /proc/fx16.html cannot be written",
        ),
        "report is a directory": (
            [
                "cast",
                folder / "corrupt.pt2",
                "-o",
                folder / "x.pt2",
                "--report",
                folder / "out_dir",
            ],
            "is a directory",
        ),
        "report cannot be written": (
            ["inspect", folder / "corrupt.pt2", "--report", "/proc/x.json"],
            "--report /proc/x.json cannot be written",
        ),
        "json is a directory": (
            ["compare", folder / "corrupt.pt2", source, "--per-node", "--json", folder / "out_dir"],
            "--json " + str(folder / "out_dir") + " is a directory",
        ),
        # and every option before it too, in one line naming the flag
        "infinite budget": (
            ["cast", folder / "corrupt.pt2", "--dry-run", "--max-rel-error", "inf"],
            "--max-rel-error must be a finite number >= 0, got inf",
        ),
        "target share above one": (
            [
                "cast",
                folder / "corrupt.pt2",
                "--dry-run",
                "--max-rel-error",
                "0.1",
                "--target-share",
                "2",
            ],
            "--target-share must be in (0, 1], got 2",
        ),
        "overflow margin below one": (
            ["cast", folder / "corrupt.pt2", "--dry-run", "--overflow-margin", "0.5"],
            "--overflow-margin must be at least 1, got 0.5",
        ),
        "unknown metric": (
            [
                "cast",
                folder / "corrupt.pt2",
                "--dry-run",
                "--max-rel-error",
                "0.1",
                "--metric",
                "l2",
            ],
            "argument --metric: invalid choice: 'l2'",
        ),
        "budget not a number": (
            ["cast", folder / "corrupt.pt2", "--dry-run", "--max-rel-error", "abc"],
            "argument --max-rel-error: invalid float value: 'abc'",
        ),
        "input range with a dash": (
            ["cast", folder / "corrupt.pt2", "--dry-run", "--input-ranges", "input_ids=0-999"],
            "argument --input-ranges: expected NAME=LO:HI (integers), got 'input_ids=0-999'",
        ),
        "unknown precision": (
            ["inspect", folder / "corrupt.pt2", "--module", "x=fp8"],
            "argument --module: expected NAME=PRECISION",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "not a pt2",
        "corrupt",
        "overwrite",
        "policy",
        "directory",
        "damaged entry",
        "wrong-shape inputs",
        "not a tensor file",
        "compare different inputs",
        "unknown import",
        "output is a directory",
        "output is a device",
        "output cannot be written",
        "negative threshold",
        "options before the program",
        "empty calibration",
        "16-bit program",
        "html is a directory",
        "html cannot be written",
        "report is a directory",
        "report cannot be written",
        "json is a directory",
        "infinite budget",
        "target share above one",
        "overflow margin below one",
        "unknown metric",
        "budget not a number",
        "input range with a dash",
        "unknown precision",
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(program, tmp_path, case):
    source, _ = program
    before = _digest(source)
    arguments, words = _bad_inputs(tmp_path, source)[case]
    result = fx16(*arguments)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr  # one line, nothing else
    assert result.stderr.startswith("fx16: error: ") and words in result.stderr
    assert _digest(source) == before
    assert not (tmp_path / "x.pt2").exists()


class Noisy(torch.nn.Module):
    """Random noise in the program itself: no precision meets a budget below it."""

    def forward(self, x):
        return x.relu() + torch.rand_like(x) * 1e-3


def test_a_budget_that_cannot_be_met_has_its_own_exit_code(program, tmp_path):
    noisy = tmp_path / "noisy.pt2"
    torch.export.save(export(Noisy(), torch.randn(4, 8)), noisy)
    result = fx16("cast", noisy, "-o", tmp_path / "x.pt2", "--max-rel-error", "1e-6", "--quiet")
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("\n") == 1 and "cannot be met" in result.stderr
    assert not (tmp_path / "x.pt2").exists()
    source, inputs = program
    arguments = ["cast", source, "-o", tmp_path / "x.pt2", "--calibrate", inputs]
    met = fx16(*arguments, "--max-rel-error", "0.05")
    assert met.returncode == 0, met.stderr
    errors = [line for line in met.stdout.splitlines() if "error" in line]
    assert len(errors) == 1  # the search's own figure, over every calibration input
    assert errors[0].startswith("accuracy: error ")
    assert "on the calibration inputs (budget 0.05" in errors[0]
    assert "exit codes: 0 done, 2 bad input" in fx16("--help").stdout


def test_overwrite_with_force(program, tmp_path):
    source, _ = program
    copy = tmp_path / "copy.pt2"
    copy.write_bytes(source.read_bytes())
    result = fx16("cast", copy, "-o", copy, "--force", "--quiet")
    assert result.returncode == 0, result.stderr
    assert {t.dtype for t in torch.export.load(copy).state_dict.values()} == {torch.float16}


def test_demo_and_console_script():
    result = fx16("demo")
    assert result.returncode == 0 and "max relative error" in result.stdout
    assert "matmul/attention FLOPs 16-bit           0%        100%" in result.stdout
    help_text = subprocess.run(["fx16", "--help"], capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "cast" in help_text.stdout


def test_transformers_programs_load_cast_and_load_back(tmp_path):
    """A transformers model returns a ModelOutput, which pytree knows only once its
    module is imported: the command imports it by the name the archive records."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16, use_cache=False
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (1, 8))
    ep = torch.export.export(transformers.GPT2LMHeadModel(config).eval(), (ids,))
    source, target = tmp_path / "g.pt2", tmp_path / "g16.pt2"
    torch.export.save(ep, source)
    commands = [["cast", source, "-o", target], ["inspect", target], ["compare", source, target]]
    for arguments in commands:
        result = fx16(*arguments)
        assert result.returncode == 0, result.stderr
    check = textwrap.dedent(
        f"""
        import torch, transformers.modeling_outputs
        ids = torch.tensor({ids.tolist()})
        paths = {str(source)!r}, {str(target)!r}
        a, b = (torch.export.load(path).module()(ids).logits for path in paths)
        assert b.dtype == torch.float16 and (a - b.float()).abs().max() < 1e-2 * a.abs().max()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, env=with_checkout(None)
    )
    assert result.returncode == 0, result.stderr


def test_an_output_type_registered_elsewhere_is_named_with_import(tmp_path):
    """The type's own module does not register it: the one-line error gives torch's
    reason and asks for --import; with it, the program loads."""
    (tmp_path / "pair_type.py").write_text(
        "import dataclasses, torch\n"
        "@dataclasses.dataclass\n"
        "class Pair:\n    first: torch.Tensor\n    second: torch.Tensor\n"
    )
    (tmp_path / "pair_registry.py").write_text(
        "import torch.utils._pytree as pytree\nfrom pair_type import Pair\n"
        "pytree.register_dataclass(Pair, serialized_type_name='pair_type.Pair')\n"
    )
    save = textwrap.dedent(
        """
        import torch, pair_registry
        from pair_type import Pair
        class Split(torch.nn.Module):
            def forward(self, x):
                return Pair(x.relu(), x * 2)
        torch.export.save(torch.export.export(Split(), (torch.randn(2, 3),)), "pair.pt2")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(CHECKOUT)])}
    subprocess.run([sys.executable, "-c", save], cwd=tmp_path, env=env, check=True)
    without = fx16("inspect", tmp_path / "pair.pt2", path=tmp_path)
    assert without.returncode == 2 and without.stderr.count("\n") == 1
    assert "pair_type.Pair" in without.stderr  # torch's words around the name are its own
    assert "; pass --import MODULE" in without.stderr
    with_import = fx16("inspect", tmp_path / "pair.pt2", "--import", "pair_registry", path=tmp_path)
    assert with_import.returncode == 0, with_import.stderr


def test_a_custom_op_is_registered_from_its_package_or_named_with_import(tmp_path):
    """A program calling ``torch.ops.NS.op`` loads only once the op is registered: the
    module of package NS whose source registers it is imported (transformers' MoE
    layers: ``transformers.integrations.moe``); an op no package names gets one line
    that asks for --import, and loads with it (``fx16.load(path, imports=...)``; the
    command's ``--import`` makes the same call: see the output-type test above)."""
    registration = (
        "import torch\n"
        "@torch.library.custom_op('{ns}::twice', mutates_args=())\n"
        "def twice(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
        "@twice.register_fake\n"
        "def _(x):\n    return torch.empty_like(x)\n"
    )
    package = tmp_path / "opspackage"
    (package / "layers").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers" / "__init__.py").write_text("")
    (package / "layers" / "kernels.py").write_text(registration.format(ns="opspackage"))
    (tmp_path / "loose_ops.py").write_text(registration.format(ns="loose"))
    save = textwrap.dedent(
        """
        import torch, opspackage.layers.kernels, loose_ops
        class Twice(torch.nn.Module):
            def __init__(self, ns):
                super().__init__()
                self.op = getattr(torch.ops, ns).twice
            def forward(self, x):
                return self.op(x).relu()
        for ns in ("opspackage", "loose"):
            ep = torch.export.export(Twice(ns), (torch.randn(2, 3),))
            torch.export.save(ep, ns + ".pt2")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(CHECKOUT)])}
    subprocess.run([sys.executable, "-c", save], cwd=tmp_path, env=env, check=True)
    found = fx16("cast", tmp_path / "opspackage.pt2", "-o", tmp_path / "o16.pt2", path=tmp_path)
    assert found.returncode == 0, found.stderr
    without = fx16("inspect", tmp_path / "loose.pt2", path=tmp_path)
    assert without.returncode == 2 and without.stderr.count("\n") == 1, without.stderr
    assert "custom op torch.ops.loose.twice" in without.stderr
    assert "pass --import MODULE" in without.stderr and len(without.stderr) < 400
    load = textwrap.dedent(
        """
        import fx16, torch
        ep = fx16.load("loose.pt2", imports="loose_ops")
        assert torch.equal(ep.module()(torch.ones(2, 3)), torch.full((2, 3), 2.0))
        try:
            fx16.load("o16.pt2", imports=["no_such_module"])
        except fx16.Fx16Error as error:
            assert "cannot import no_such_module" in str(error)
        else:
            raise AssertionError("no error")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", load], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


class TokenModel(torch.nn.Module):
    """Token ids through an embedding of 10 rows, then a linear layer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, ids):
        return self.fc(self.embed(ids))


@pytest.mark.parametrize(
    "inputs, words",
    [
        (
            lambda: [(torch.rand(2, 5),)],
            "input 'ids' is floating point (float32); the program takes",
        ),
        (lambda: [(torch.full((2, 5), 50),)], "INPUTS.pt[0]: the program fails on it: IndexError"),
    ],
)
def test_calibration_inputs_are_checked_before_anything_runs(tmp_path, inputs, words):
    """Float ids where the program takes int64, ids past the vocabulary: one line, exit 2."""
    source = tmp_path / "tokens.pt2"
    torch.export.save(export(TokenModel(), torch.randint(0, 10, (2, 5))), source)
    torch.save(inputs(), tmp_path / "INPUTS.pt")
    result = fx16("cast", source, "--dry-run", "--calibrate", "INPUTS.pt", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr


def test_a_tensor_file_given_as_the_program_is_named_as_such(program, tmp_path):
    _, inputs = program
    result = fx16("cast", inputs, "--dry-run")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "written by torch.save (tensors or inputs), not a program" in result.stderr


def test_the_command_line_covers_the_api(tmp_path):
    """Input ranges, per-module/op/node overrides, --keep-io by the model's output
    name, inspect --report, --version, --timings."""
    from models import Int32Arithmetic

    source = tmp_path / "ints.pt2"
    numbers = torch.arange(6, dtype=torch.int32)
    torch.export.save(export(Int32Arithmetic(), numbers, numbers), source)
    report = tmp_path / "r.json"
    ranges = ["--input-ranges", "a=0:100", "--input-ranges", "b=0:100"]
    narrowed = fx16("inspect", source, *ranges, "--report", report)
    assert narrowed.returncode == 0, narrowed.stderr
    assert "integer values narrowed to int16: 0" not in narrowed.stdout
    document = json.loads(report.read_text())
    assert document["provenance"]["options"]["input_ranges"] == {"a": [0, 100], "b": [0, 100]}
    assert document["provenance"]["input"] == str(source)

    mlp = tmp_path / "mlp.pt2"
    torch.manual_seed(0)
    torch.export.save(export(MLP(), torch.randn(4, 8)), mlp)
    overrides = ["--module", "layers.1=fp32", "--op", "gelu=fp32", "--keep-io", "0"]
    result = fx16("cast", mlp, "--dry-run", "--report", report, "--timings", *overrides)
    assert result.returncode == 0, result.stderr
    rows = {row["node"]: row for row in json.loads(report.read_text())["nodes"]}
    assert rows["linear_1"]["detail"] == "modules['layers.1'] = fp32"
    assert rows["gelu"]["detail"] == "ops['gelu'] = fp32"
    assert "fx16 timings: start-up" in result.stderr and "cast " in result.stderr
    assert not (tmp_path / "mlp16.pt2").exists()  # --dry-run: no -o, and nothing written
    unknown = fx16("cast", mlp, "--dry-run", "--module", "layers.9=fp32")
    assert unknown.returncode == 2 and "closest: " in unknown.stderr
    version = fx16("--version")
    assert version.returncode == 0 and version.stdout.startswith("fx16 ")


def test_help_covers_every_option_and_needs_no_torch():
    text = fx16("cast", "--help").stdout
    for option in ("--int16", "--keep-io-types", "--max-rel-error", "--input-ranges", "--node"):
        line = text[text.index(option) :].split("\n--")[0]
        assert len(line.split()) > 4, option  # the option, its metavar and words about it
    assert 'torch.autocast("cpu", dtype=torch.bfloat16)' in text
    assert "a list of input tuples" in fx16("compare", "--help").stdout
    check = (
        "import sys\nfrom fx16.cli import main\n"
        "try:\n    main(['cast', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'fx16 --help imported torch'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, env=with_checkout(None)
    )
    assert result.returncode == 0, result.stderr


def test_per_node_with_nothing_over_the_threshold_says_so(program):
    """compare --per-node of a program with itself: no bare table header."""
    source, _ = program
    result = fx16("compare", source, source, "--per-node")
    assert result.returncode == 0, result.stderr
    assert "no value differs by more than 0.01" in result.stdout


def test_subprocesses_run_the_checkout_under_test(tmp_path):
    """In a clone or worktree the command a subprocess runs is this checkout's fx16, not
    an editable install of another one."""
    from pathlib import Path

    probe = "import fx16, sys; print(fx16.__file__)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=with_checkout(env)
    )
    assert Path(result.stdout.strip()).resolve().is_relative_to(CHECKOUT.resolve())
