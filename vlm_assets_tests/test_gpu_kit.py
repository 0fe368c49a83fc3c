"""The GPU kit's CPU side (scripts/gpu-check.sh, scripts/gpu_kit.py): its plan fits one 7.5-minute device
call, the carry's stamp names the commit a copy without .git is, an oversized carry, a long plan or an
incomplete carry is refused naming it, what it runs on the GPU machine imports no Dagster or MLflow (they
are not carried), a part past its limit keeps its rows, a skipped test fails a run that asks for it, and
the whole kit rehearses on CPU in an environment holding only the GPU machine's packages and the carry
(installed offline)."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlm_assets_tests.waiting import BOUND_S

REPO = Path(__file__).resolve().parents[1]


def gpu_kit():
    spec = importlib.util.spec_from_file_location("gpu_kit", REPO / "scripts" / "gpu_kit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_plan_fits_one_device_call_of_eight_minutes_and_names_the_carry():
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu-check.sh"), "--plan", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["problems"] == []
    assert plan["total_s"] <= 480 and plan["run_limit_s"] == 480
    parts = plan["parts"]
    assert [p["name"] for p in parts] == ["smoke", "gpt", "visualchat", "adapter", "tests"]
    assert parts[0]["limit_s"] <= 30  # a broken environment costs seconds
    for part in parts:  # every file a part names exists, on the GPU and in the rehearsal
        for arg in (*part["gpu"], *part["rehearse"]):
            if arg.endswith(".py"):
                assert (REPO / arg.split("::")[0]).is_file(), arg
    assert {"pydantic", "deepspeed", "dagster_pipes", "streaming"} <= set(plan["carry"]["modules"])
    assert plan["carry"]["tree_bytes"] < 8 * 2**20  # the working tree leaves the carry its room


def test_an_oversized_carry_a_long_plan_or_a_late_smoke_test_is_refused_naming_it(tmp_path):
    kit = gpu_kit()
    (tmp_path / "wheels").mkdir()
    with open(tmp_path / "wheels" / "big.whl", "wb") as f:
        f.truncate(41 * 2**20)  # sparse: 41 MiB on paper
    problems = kit.plan(tmp_path)["problems"]
    assert len(problems) == 1 and "over 40 MiB" in problems[0], problems
    smoke = kit.Part("smoke", 30, (), (), "")
    slow = [smoke, kit.Part("bench", 430, ("b.py",), ("b.py",), "")]
    assert kit.check_plan(slow) == [f"the parts' limits add up to {kit.PREPARE_S + 460} s, over 480 s"]
    late = [kit.Part("bench", 100, ("b.py",), ("b.py",), ""), smoke]
    assert kit.check_plan(late) == ["the kit must begin with a smoke test of at most 30 s"]


def test_an_incomplete_carry_is_named_and_an_unknown_part_lists_the_parts(tmp_path):
    kit = gpu_kit()
    assert kit.carry_problems(tmp_path) == [f"{tmp_path}: no carry (scripts/gpu-check.sh --fetch)"]
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "hjson-3.1.0-py3-none-any.whl").write_bytes(b"x" * 10)
    (tmp_path / "carry.json").write_text(
        json.dumps(
            {"files": {"wheels/hjson-3.1.0-py3-none-any.whl": 10, "wheels/deepspeed-0.19.8-py3-none-any.whl": 5}}
        )
    )
    assert kit.carry_problems(tmp_path) == [
        f"{tmp_path / 'wheels/deepspeed-0.19.8-py3-none-any.whl'}: missing or changed"
    ]
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_kit.py", "--rehearse", "--only", "bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "--only bench: no such part; the parts are smoke, gpt, visualchat, adapter, tests" in proc.stderr


def test_a_copy_is_named_by_the_carrys_stamp_while_its_files_match_else_by_its_git(tmp_path):
    kit = gpu_kit()
    checkout, copy, carry = tmp_path / "checkout", tmp_path / "copy", tmp_path / "carry"
    checkout.mkdir()
    (checkout / ".gitignore").write_text("var/\n")
    (checkout / "train.py").write_text("steps = 10\n")

    def git(*args: str) -> str:
        run = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=checkout, check=True,
                             capture_output=True, text=True)  # fmt: skip
        return run.stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    head = git("rev-parse", "HEAD")
    kit.REPO = checkout
    assert kit.stamp_tree(carry)["commit"] == head
    (checkout / "var").mkdir()
    (checkout / "var" / "out.txt").write_text("ignored: never sent\n")
    (checkout / "conftest.py").write_text("untracked, sent\n")
    stamp = kit.stamp_tree(carry)
    assert stamp["commit"] == head + "+dirty" and set(stamp["files"]) == {".gitignore", "train.py", "conftest.py"}

    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".git"))  # the device tool's copy
    kit.REPO = copy
    assert kit.tree_commit(carry) == head + "+dirty"
    (copy / "train.py").write_text("steps = 20\n")
    assert kit.tree_commit(carry) == f"unknown: 1 file(s) differ from {head}+dirty (train.py)"
    (copy / "conftest.py").unlink()
    assert kit.tree_commit(carry) == f"unknown: 2 file(s) differ from {head}+dirty (conftest.py, train.py)"
    assert kit.tree_commit(tmp_path / "elsewhere").startswith("unknown (no .git and no tree stamp")
    with pytest.raises(SystemExit, match="not a git checkout"):
        kit.stamp_tree(carry)

    (copy / "train.py").write_text("steps = 10\n")
    (copy / "conftest.py").write_text("untracked, sent\n")
    shutil.copytree(checkout / ".git", copy / ".git")
    git("-C", str(copy), "commit", "-qm", "another", "--allow-empty")  # the copy's .git names another commit
    assert kit.tree_commit(carry) == head + "+dirty"  # the stamp decides
    copy_head = git("-C", str(copy), "rev-parse", "HEAD")
    assert kit.tree_commit(tmp_path / "elsewhere") == copy_head + "+dirty"  # no stamp: git
    (copy / "train.py").write_text("steps = 30\n")
    assert kit.tree_commit(carry) == copy_head + "+dirty"  # a stamp the tree has moved on from: git


@pytest.mark.slow  # imports every part in a process of its own
def test_what_the_kit_runs_imports_no_dagster_or_mlflow():
    """Dagster and MLflow are not carried: the engine-level gpu tests and the benches must not need them."""
    code = """
import sys, importlib.util
for name in ("dagster", "mlflow", "kubernetes", "boto3"):
    sys.modules[name] = None  # an import of any of them fails here
sys.path.insert(0, "bench")
import vlm_assets_tests.gpu.test_gpu_visualchat, vlm_assets_tests.gpu.test_gpu_compile
import vlm_assets_tests.train.test_visualchat_train
import bench_gpt, bench_adapter, bench_visualchat
import vlm_assets.train.visualchat_train, vlm_assets.train.adapter_train, vlm_assets.launch.local
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_part_past_its_limit_is_stopped_with_its_children_and_keeps_its_rows(tmp_path):
    kit = gpu_kit()
    code = (
        "import json, os, subprocess, time\n"
        "open(os.environ['BENCH_ROWS'], 'a').write(json.dumps({'tokens_per_s': 5.0}) + '\\n')\n"
        "print(subprocess.Popen(['sleep', '60']).pid, flush=True)\n"
        "time.sleep(60)"
    )
    started = time.monotonic()
    result = kit.run_part(kit.Part("hangs", 2, ("-c", code), ("-c", code), ""), tmp_path, rehearse=False, site=None)
    assert time.monotonic() - started < 30
    assert result["status"] == "over its 2 s limit" and result["rows"] == [{"tokens_per_s": 5.0}]
    kit.record(tmp_path, {"device": "X", "rehearse": False}, result)
    assert "## hangs: over its 2 s limit" in (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["parts"][0]["rows"] == [{"tokens_per_s": 5.0}]
    stamp, child = re.match(r"\[ *(\d+\.\d) s\] (\d+)$", (tmp_path / "hangs.log").read_text().strip()).groups()
    assert float(stamp) < 2, stamp  # each logged line carries its time into the part
    child = int(child)

    def gone() -> bool:  # exited (a zombie until init reaps it), or reaped
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + BOUND_S
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), f"the part's child {child} outlived it"


@pytest.mark.parametrize("fail_on_skip, expected", [("1", 1), ("", 0)])
def test_a_skip_fails_the_run_when_asked(tmp_path, fail_on_skip, expected):
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\ndef test_skips():\n    pytest.skip('no deepspeed')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "vlm_assets_tests.conftest", "-p", "no:cacheprovider"]
        + ["--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_skips.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "VLM_TESTS_FAIL_ON_SKIP": fail_on_skip},
    )
    assert proc.returncode == expected, proc.stdout[-2000:]
    assert ("1 test(s) skipped, which fails this run" in proc.stdout) == (expected == 1)


@pytest.mark.slow
def test_the_kit_rehearses_on_cpu_in_the_gpu_machines_stack_with_the_offline_carry(tmp_path):
    """CI's run of ``scripts/gpu-check.sh --rehearse`` in scripts/gpu-like-env.sh's environment: torch,
    transformers 5.17, Lightning 2.6, peft... and no Dagster, MLflow or pydantic but what the carry brings."""
    env_dir = Path(
        subprocess.run(
            [str(REPO / "scripts" / "gpu-like-env.sh")], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    python = env_dir / "venv" / "bin" / "python"
    names = "('dagster', 'mlflow', 'pydantic', 'deepspeed')"
    present = f"import importlib.util as u; print([m for m in {names} if u.find_spec(m)])"
    stack = subprocess.run([str(python), "-c", present], capture_output=True, text=True, check=True)
    assert stack.stdout.strip() == "[]"  # the carry brings pydantic and DeepSpeed, installed by the kit
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.run(
        [str(REPO / "scripts" / "gpu-check.sh"), "--rehearse", "--carry", str(env_dir / "carry")],
        capture_output=True,
        text=True,
        env={**env, "OUT": str(tmp_path), "GPU_CHECK_PYTHON": str(python)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["header"]["transformers"].startswith("5.17")
    parts = {p["part"]: p for p in results["parts"]}
    assert [p["status"] for p in parts.values()] == ["ok"] * 5
    gpt = {row["model"]: row for row in parts["gpt"]["rows"]}
    trainer = gpt["ours through the trainer"]
    assert trainer["tokens_per_s"] > 0 and trainer["launch_to_first_step_s"] < trainer["run_s"]
    assert trainer["loss"] < gpt["ours: SDPA + padded head"]["loss"]  # ten steps on real text learn
    unpacked, packed = sorted(parts["visualchat"]["rows"], key=lambda row: row["packing"])
    assert packed["pack_tokens"] == 256 and packed["packing_efficiency"] >= unpacked["packing_efficiency"]
    assert packed["images_per_step"] > 0 and packed["loss"] < 12  # finite, about ln(vocabulary) untrained
    # both settings measured (their ratio is a GPU figure: 2 cores under CI's load say nothing of it)
    adapter = parts["adapter"]["rows"]
    assert [row["setting"].split()[0] for row in adapter] == ["seed", "ours"]
    assert all(row["samples_per_s"] > 0 and row["peak_bytes"] > 2**20 for row in adapter)


@pytest.mark.slow  # imports the whole stack in a process of its own
def test_the_smoke_test_names_a_missing_package_and_the_wheels_that_bring_it(tmp_path):
    # torchdata made unimportable for this process only, as on a GPU machine without the carry
    (tmp_path / "torchdata").mkdir()
    (tmp_path / "torchdata" / "__init__.py").write_text("raise ImportError('not on this machine')\n")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_kit.py"), "--smoke"],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "smoke: missing packages: torchdata (not on this machine): carry torchdata" in proc.stderr, proc.stderr
    assert "scripts/gpu-check.sh --fetch" in proc.stderr
