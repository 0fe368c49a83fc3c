"""VisualChat training through the launcher: 2 processes on gloo with ZeRO-2 and ZeRO-3 train on real
Fashion-MNIST images (the occlusion manifests as VQA and two-image conversations) and real CIFAR-10
images (a chat-messages JSONL), merge LoRA (merged == unmerged within 1e-4), export, reload and answer;
a SIGKILLed run resumes at the same global step on the same loss curve; bad input fails before
training naming the file and line."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vlm_assets.data import visualchat_data as vd
from vlm_assets.data.chat_formats import read_chat_dataset
from vlm_assets.launch import run_local
from vlm_assets.models.visualchat import VisualChatModel
from vlm_assets.train.run_config import RunPaths, overlay, write_run_file
from vlm_assets.train.visualchat_config import VisualChatTrainConfig
from vlm_assets_tests.conftest import training_workers
from vlm_assets_tests.models.visualchat_fixtures import tiny_clip, tiny_decoder, tiny_model_section
from vlm_assets_tests.waiting import BOUND_S

CIFAR = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, offline_data) -> Path:
    return make_inputs(tmp_path_factory.mktemp("visualchat"), offline_data)


def make_inputs(root: Path, offline_data: Path) -> Path:
    """A tiny CLIP and Llama, Fashion-MNIST manifests and a CIFAR-10 chat JSONL under ``root``."""
    from vlm_assets.data.image_sources import load_fashion_mnist
    from vlm_assets.data.occlusion import BoxBounds, write_occlusion_manifests

    tiny_clip(root / "clip")
    tiny_decoder(root / "llama", offline_data)
    write_occlusion_manifests(
        load_fashion_mnist(offline_data / "fashion-mnist"),
        root / "manifests",
        num_train=40,
        num_validation=10,
        train_box=BoxBounds(0.2, 0.4),
        validation_box=BoxBounds(0.2, 0.4),
        seed=0,
    )
    files = sorted((offline_data / "cifar10-samples").glob("cifar10_*.png"))
    with open(root / "cifar.jsonl", "w") as out:
        for f in files:
            out.write(
                json.dumps(
                    {
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {"type": "image", "image": str(f)},
                                    {"type": "text", "text": "What is shown?"},
                                ],
                            },
                            {"role": "assistant", "content": CIFAR[int(f.stem.split("_")[2])]},
                        ]
                    }
                )
                + "\n"
            )
    return root


def config(inputs: Path, **overrides) -> VisualChatTrainConfig:
    settings = {
        # LoRA dropout's random masks: a resumed run must draw the same ones (StepSeed)
        "model": tiny_model_section(inputs / "clip", inputs / "llama", lora_dropout=0.1),
        "optimizer": {"global_batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "max_steps": 6},
        "data": {"pair_count": 12, "chat_datasets": {str(inputs / "cifar.jsonl"): 10}},
        "checkpoint": {"every": 3},
        "parallelism": {"nproc_per_node": 2, "micro_batch_size": 2},
        "log_every": 3,
        "timeout_s": 600,
    }
    return VisualChatTrainConfig(**overlay(settings, overrides))


def run_file(inputs: Path, work: Path, cfg: VisualChatTrainConfig) -> Path:
    paths = RunPaths(
        inputs={"occlusion_manifests": str(inputs / "manifests")},
        out_dir=str(work / "out"),
        cache_dir=str(work / "cache"),
        checkpoint_store={"kind": "local", "root": str(work / "store")},
        checkpoint_prefix="checkpoints/visualchat",
    )
    write_run_file(work / "run.json", cfg, paths)
    return work / "run.json"


def train(inputs: Path, work: Path, cfg: VisualChatTrainConfig) -> dict:
    lines: list[str] = []
    spec = cfg.launch_spec(
        "vlm_assets.train.visualchat_train", ("--config", str(run_file(inputs, work, cfg))), name="visualchat"
    )
    run_local(spec, on_line=lines.append)
    reported = [json.loads(line.split("] ", 1)[1])["materialization"] for line in lines if '{"materialization"' in line]
    assert len(reported) == 1, "\n".join(lines[-40:])
    assert not [line for line in lines if "Warning" in line], [line for line in lines if "Warning" in line]
    return {**reported[0], "history": json.loads((work / "out" / "history.json").read_text())["train"], "lines": lines}


@pytest.fixture(scope="module")
def zero2(inputs, tmp_path_factory) -> tuple[dict, Path]:
    work = tmp_path_factory.mktemp("zero2")
    return train(inputs, work, config(inputs)), work


def check_trained_and_exported(
    result: dict, out: Path, inputs: Path, backend: str = "gloo", param_dtype: str = "float32"
) -> None:
    """What every VisualChat training must have done; the GPU twin passes ("nccl", "bfloat16")."""
    from vlm_assets.data.occlusion import read_manifest
    from vlm_assets.evaluate.visualchat_eval import two_image_conversation, vqa_exact_match

    assert (result["backend"], result["param_dtype"]) == (backend, param_dtype)  # read from the group and weights
    assert result["merge_max_abs_diff"] < 1e-4
    assert result["eval_loss"] < result["baseline_eval_loss"], result
    history = result["history"]
    assert [h["step"] for h in history] == list(range(1, 7))
    # tokens/s can be no more than full rows over the time the steps took (their end times: the last five)
    config = json.loads((out.parent / "run.json").read_text())["config"]
    row = config["data"]["pack_tokens"] if config["data"]["packing"] else config["model"]["max_length"]
    row_cap = config["optimizer"]["global_batch_size"] * row
    assert 0 < result["tokens_per_s"] <= 5 * row_cap / (history[-1]["time"] - history[0]["time"])
    model = VisualChatModel.from_pretrained(out / "model")
    assert not any("lora" in name for name, _ in model.named_parameters())
    vqa = vqa_exact_match(model, inputs / "manifests", "validation", count=4)
    # the questions are about the validation manifest's first four images, in order, with their true labels
    manifest = read_manifest(inputs / "manifests" / "validation.jsonl")[:4]
    assert [p["label"] for p in vqa["predictions"]] == [row["label"] for row in manifest]
    assert vqa["num_images"] == 4 and vqa["chance"] == 0.1
    low, high = vqa["ci95"]
    assert low <= vqa["exact_match"] <= high and vqa["exact_match"] * 4 in range(5)
    conversation = two_image_conversation(model, inputs / "manifests")
    assert [m["role"] for m in conversation] == ["user", "assistant", "user", "assistant"]
    assert all(isinstance(m["content"], str) for m in conversation[1::2])


@pytest.mark.slow
def test_zero2_two_processes_train_merge_export_and_answer(zero2, inputs):
    result, work = zero2
    check_trained_and_exported(result, work / "out", inputs)
    assert any("trains projection, lora: " in line for line in result["lines"])  # the trainable count is logged


@pytest.mark.slow
def test_zero3_with_packing_and_checkpointing_trains_merges_from_partitions_and_answers(inputs, tmp_path):
    result = train(
        inputs,
        tmp_path,
        config(
            inputs,
            # the feature cache's warm-up runs the partitioned encoder: the ranks' forwards must pair up
            parallelism={"zero_stage": 3, "gradient_checkpointing": True, "cache_image_features": True},
            data={"packing": True, "pack_tokens": 512},
        ),
    )
    check_trained_and_exported(result, tmp_path / "out", inputs)
    assert any("image features: 0 image(s) encoded by the steps" in line for line in result["lines"])


@pytest.mark.slow
def test_sigkill_mid_training_resumes_at_the_same_step_and_loss_curve(zero2, inputs, tmp_path):
    """The launcher and every worker are SIGKILLed once step 3 is committed (the workers too: their
    parent-death signals can take long enough for 3 more small steps and a checkpoint; that path
    is test_local_launcher's); the relaunch resumes at step 3 and ends on the uninterrupted run's curve."""
    uninterrupted, _ = zero2
    cfg = config(inputs)
    run = run_file(inputs, tmp_path, cfg)
    script = (
        "import sys; from vlm_assets.launch import LaunchSpec, run_local; "
        f"run_local(LaunchSpec('vlm_assets.train.visualchat_train', ('--config', {str(run)!r}), nproc_per_node=2, "
        "timeout_s=600))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    committed = tmp_path / "store" / "checkpoints" / "visualchat" / "step-00000003"
    deadline = time.monotonic() + BOUND_S
    while not committed.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert committed.exists() and proc.poll() is None, "step 3 was never committed while the run was alive"
    for pid in [proc.pid, *training_workers("vlm_assets.train.visualchat_train", str(tmp_path))]:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "out" / "history.json").exists()
    resumed = train(inputs, tmp_path, cfg)
    assert resumed["resumed_from_step"] == 3 and resumed["steps"] == 6
    assert [h["step"] for h in resumed["history"]] == list(range(1, 7))
    torch.testing.assert_close(
        torch.tensor([h["loss"] for h in resumed["history"]]),
        torch.tensor([h["loss"] for h in uninterrupted["history"]]),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.slow
def test_a_run_resumed_at_its_last_step_measures_the_held_out_loss_again(zero2, inputs, tmp_path):
    """A retry after training ended (its export failed, say) resumes at the last checkpoint, where
    Lightning runs no training loop and so no on_train_end: the held-out loss is measured all the same."""
    finished, work = zero2
    shutil.copytree(work / "store", tmp_path / "store")
    resumed = train(inputs, tmp_path, config(inputs))
    assert resumed["resumed_from_step"] == 6 and resumed["steps"] == 6
    assert resumed["eval_loss"] == pytest.approx(finished["eval_loss"], rel=1e-5)
    assert resumed["eval_loss"] < resumed["baseline_eval_loss"]


@pytest.mark.slow
def test_image_features_encoded_once_across_the_ranks_train_the_same_curve(zero2, inputs, tmp_path):
    """With the encoder's features cached, the two ranks split the images (each encoded once, a share
    padded to equal length), share their features before the first step, and no step on either rank
    encodes an image again; the loss curve is the uncached run's."""
    uncached, _ = zero2
    result = train(inputs, tmp_path, config(inputs, parallelism={"cache_image_features": True}))
    shared = [line for line in result["lines"] if "encoder passes over 2 process(es)" in line]
    assert len(shared) == 1, result["lines"][-40:]
    images, passes = map(int, re.search(r"image features: (\d+) images, (\d+) encoder passes", shared[0]).groups())
    assert images > 40  # the manifests' 40 training images, the CIFAR files and the held-out samples' images
    assert passes == 2 * -(-images // 2)  # not 2 * images: each rank encoded its half
    assert any("image features: 0 image(s) encoded by the steps" in line for line in result["lines"])
    torch.testing.assert_close(
        torch.tensor([h["loss"] for h in result["history"]]),
        torch.tensor([h["loss"] for h in uncached["history"]]),
        rtol=1e-4,
        atol=1e-5,
    )


# -- bad input: before any training ----------------------------------------------------------------
def _jsonl(tmp_path: Path, *records) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize(
    "record, error",
    [
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "image": "nope.png"}]},
                    {"role": "assistant", "content": "x"},
                ]
            },
            "image file .*nope.png does not exist",
        ),
        (
            {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            "unknown role 'robot'",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ],
)
def test_a_bad_chat_record_names_file_and_line(tmp_path, record, error):
    path = _jsonl(tmp_path, GOOD, record)
    with pytest.raises(ValueError, match=f"{path}:2: {error}"):
        read_chat_dataset(path, max_images=8)


def test_more_images_than_max_images_names_file_and_line(tmp_path, offline_data):
    image = str(sorted((offline_data / "cifar10-samples").glob("*.png"))[0])
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": image}] * 3},
            {"role": "assistant", "content": "three"},
        ]
    }
    path = _jsonl(tmp_path, record)
    with pytest.raises(ValueError, match=f"{path}:1: 3 images, more than max_images 2"):
        read_chat_dataset(path, max_images=2)


def test_more_tokens_than_max_length_fails_before_training(tmp_path, inputs):
    path = _jsonl(
        tmp_path,
        GOOD,
        {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "ok"}]},
    )
    cfg = config(inputs, data={"chat_datasets": {str(path): None}}, model={"max_length": 128})
    from vlm_assets.train.visualchat_train import build_model, build_samples

    with pytest.raises(ValueError, match=f"{path}:2: .* tokens .*more than max_length 128"):
        build_samples(cfg, build_model(cfg), None)


def test_a_zero_stage_other_than_2_or_3_is_refused_at_config_load(tmp_path, inputs):
    from vlm_assets.train.run_config import read_run_file

    run = run_file(inputs, tmp_path, config(inputs))
    data = json.loads(run.read_text())
    data["config"]["parallelism"]["zero_stage"] = 1
    run.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{run}: field parallelism.zero_stage: zero_stage 1 is not supported"):
        read_run_file(run, VisualChatTrainConfig)


def test_an_encoder_image_size_that_cannot_be_built_is_refused_at_config_load(tmp_path, inputs):
    from vlm_assets.train.run_config import read_run_file

    run = run_file(inputs, tmp_path, config(inputs))
    data = json.loads(run.read_text())
    data["config"]["model"]["encoder_image_size"] = 128  # the config's encoder is a CLIP
    run.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="encoder_image_size is for the efficientnet_lite0 encoder only, not clip"):
        read_run_file(run, VisualChatTrainConfig)
    data["config"]["model"].update(encoder_kind="efficientnet_lite0", encoder=None, encoder_image_size=100)
    run.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{run}: field model.encoder_image_size: encoder_image_size 100 must be"):
        read_run_file(run, VisualChatTrainConfig)


def test_images_by_http_url_load_like_the_same_files(tmp_path, offline_data, monkeypatch):
    """A chat record's images by http(s) URL (served on loopback), fetched once into the image cache, give
    the pixels of the same files."""
    monkeypatch.setenv("VLM_ASSETS_CACHE", str(tmp_path / "cache"))
    from vlm_assets_tests.conftest import serve_directory

    files = sorted((offline_data / "cifar10-samples").glob("*.png"))[:2]
    with serve_directory(files[0].parent) as (base, requests):
        record = {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": f"{base}/{f.name}"} for f in files]
                    + [{"type": "text", "text": "Which one is a cat?"}],
                },
                {"role": "assistant", "content": "Image 2"},
            ]
        }
        (loaded,) = read_chat_dataset(_jsonl(tmp_path, record), max_images=8)
        pixels = torch.stack([vd.load_image(ref, 64) for ref in loaded.images])
    assert all(Path(ref).parent == tmp_path / "cache" / "chat-images" for ref in loaded.images)
    assert sorted(requests) == sorted(f"/{f.name}" for f in files)
    assert torch.equal(pixels, torch.stack([vd.load_image(str(f), 64) for f in files]))


def test_first_fit_packing_fills_rows_largest_first():
    assert vd.pack([5, 3, 4, 2, 6], budget=8) == [[4, 3], [0, 1], [2]]
    with pytest.raises(ValueError, match="more than the packing budget"):
        vd.pack([9], budget=8)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own call, as in the trainer
def test_a_loader_restored_in_its_second_epoch_goes_on_with_that_epochs_order():
    """Lightning restores the loader's position before it sets the sampler's epoch: the sampler keeps its
    epoch in its own state (bench/soak.py: a VisualChat run resumed at step 16 of 24, in its second epoch,
    trained on the rest of the first epoch's order)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from vlm_assets.train.visualchat_train import EpochSampler

    def loader(rank: int) -> StatefulDataLoader:
        data = list(range(16))
        return StatefulDataLoader(data, batch_size=2, sampler=EpochSampler(data, num_replicas=2, rank=rank, seed=3))

    for rank in (0, 1):
        first = loader(rank)
        first.sampler.set_epoch(1)
        batches = iter(first)
        seen = [next(batches).tolist() for _ in range(2)]
        state = first.state_dict()
        rest = [b.tolist() for b in batches]
        restored = loader(rank)
        restored.load_state_dict(state)  # and no set_epoch, as Lightning on a restart
        assert [b.tolist() for b in restored] == rest and len(seen + rest) == 4
        assert restored.sampler.epoch == 1


def test_a_run_resumed_at_its_epochs_last_step_goes_on_with_the_next_epochs_order(tmp_path):
    """A checkpoint saved after the last batch of an epoch (bench/soak.py: VisualChat resumed at step 16,
    its first epoch's last): Lightning resumes in the next epoch, which must be that epoch's whole order
    (the restored position had emptied it, and the run went on with the epoch after)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torchdata.stateful_dataloader import StatefulDataLoader

    from vlm_assets.train.visualchat_train import EpochSampler

    class Recorder(L.LightningModule):
        def __init__(self, stop_at: int | None = None):
            super().__init__()
            self.w, self.seen, self.stop_at = torch.nn.Parameter(torch.zeros(1)), [], stop_at

        def training_step(self, batch, batch_idx):
            if self.global_step == self.stop_at:
                raise RuntimeError("stopped")  # as a kill: no checkpoint past step 4
            self.seen.append((self.global_step, batch.tolist()))
            return (self.w * batch.float()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(module: Recorder, folder: str, ckpt_path: str | None = None) -> None:
        data = list(range(8))  # 4 steps an epoch
        loader = StatefulDataLoader(data, batch_size=2, sampler=EpochSampler(data, num_replicas=1, rank=0, seed=3))
        every4 = ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=4, save_top_k=-1)
        trainer = L.Trainer(
            max_steps=10, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[every4]
        )
        trainer.fit(module, loader, ckpt_path=ckpt_path)

    fit(uninterrupted := Recorder(), "a")
    with pytest.raises(RuntimeError, match="stopped"):
        fit(Recorder(stop_at=5), "b")
    fit(resumed := Recorder(), "c", ckpt_path=str(next((tmp_path / "b").glob("*step=4.ckpt"))))
    assert resumed.seen == uninterrupted.seen[4:]


def test_the_held_out_evaluation_leaves_every_module_in_its_mode(inputs):
    """A fresh run evaluates the untrained model before training, a resumed one does not: the evaluation
    must leave the frozen decoder (eval mode, no dropout) as it found it, or the two runs train different
    models (bench/soak.py: a GPT-2 decoder's dropout on after a fresh start only)."""
    from vlm_assets.train.visualchat_train import build_model, build_samples, evaluate

    cfg = config(inputs, data={"chat_datasets": {}})
    model = build_model(cfg)
    _, samples = build_samples(cfg, model, inputs / "manifests")
    model.decoder.eval()  # as from_pretrained leaves it
    modes = {name: module.training for name, module in model.named_modules()}
    assert not all(modes.values()) and any(modes.values())  # a mix: the test can tell one from the other
    loss = evaluate(model, samples[:4], torch.device("cpu"))
    assert loss > 0 and {name: module.training for name, module in model.named_modules()} == modes


def test_the_template_learns_only_the_answers(inputs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(inputs / "llama")
    record = vd.manifest_records(inputs / "manifests", "train", pairs=1, seed=0)[-1]
    sample = vd.render(record, tokenizer, image_token_id=50000, num_image_tokens=4, max_length=512)
    learned = tokenizer.decode([t for t in sample.labels if t != vd.IGNORE_INDEX])
    answers = [m["content"] for m in record.messages if m["role"] == "assistant"]
    assert learned == "<|endoftext|>".join(answers) + "<|endoftext|>"
    assert sample.ids.count(50000) == 8 and "### Image 2:" in tokenizer.decode(sample.ids)


class Terminal:
    """A program on a pseudo-terminal: type lines, read the screen until a marker shows."""

    def __init__(self, argv: list[str]):
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the program, its stdin/stdout the terminal
            os.execvpe(argv[0], argv, os.environ)
        self.screen = ""

    def read_until(self, marker: str, count: int = 1, timeout: float = 120) -> str:
        import select

        poll = select.poll()  # not select(): late in a long session the pty's descriptor may be >= 1024
        poll.register(self.fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while self.screen.count(marker) < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {marker!r} (x{count}) on the terminal after {timeout} s:\n{self.screen[-2000:]}"
                )
            if poll.poll(500):
                self.screen += os.read(self.fd, 4096).decode(errors="replace")
        return self.screen

    def type(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())

    def exit_code(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(status)


@pytest.mark.slow  # the zero2 fixture: a two-process DeepSpeed training
def test_the_chat_cli_answers_a_two_image_two_round_conversation_in_a_terminal(zero2, offline_data):
    _, work = zero2
    cat, ship = (offline_data / "cifar10-samples" / name for name in ("cifar10_00_3.png", "cifar10_01_8.png"))
    term = Terminal([sys.executable, "-m", "vlm_assets.chat", str(work / "out" / "model"), "--max-new-tokens", "4"])
    term.read_until("you> ")
    term.type(f"/image {cat}")
    term.read_until("(image 1 attached: cifar10_00_3.png)")
    term.type(f"/image {ship}")
    term.read_until("(image 2 attached: cifar10_01_8.png)")
    term.type("/image /no/such.png")
    term.read_until("(no image file /no/such.png)")
    term.type("Which of these is a ship?")
    term.read_until("visualchat> ")
    term.read_until("you> ", count=5)  # the answer streamed, then the next prompt
    term.type("And the other one?")
    term.read_until("visualchat> ", count=2)
    screen = term.read_until("you> ", count=6)
    term.type("/quit")
    assert term.exit_code() == 0
    answers = [part.split("\r\n", 1)[0] for part in screen.split("visualchat> ")[1:]]
    assert len(answers) == 2, screen


def test_a_sample_longer_than_the_decoders_positions_fails_naming_them(tmp_path, inputs, offline_data):
    gpt2 = tiny_decoder(tmp_path / "gpt2", offline_data, "gpt2")
    path = _jsonl(
        tmp_path,
        GOOD,
        {"messages": [{"role": "user", "content": "word " * 1100}, {"role": "assistant", "content": "ok"}]},
    )
    cfg = config(inputs, model={"decoder": str(gpt2), "max_length": 4096}, data={"chat_datasets": {str(path): None}})
    from vlm_assets.train.visualchat_train import build_model, build_samples

    with pytest.raises(
        ValueError, match=f"{path}:2: .*more than max_length 1024 \\(the decoder .* has 1024 positions\\)"
    ):
        build_samples(cfg, build_model(cfg), None)
