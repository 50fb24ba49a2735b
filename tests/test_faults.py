"""Faults a careless user meets, each one line and exit status 2: a missing required value, a
checkpoint of another architecture (for inference, resuming and fine-tuning).

Entry points run in this process (``run_main``); the checkpoints come from real two-step runs of
four families made by ``attnlab-train``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import QUIET, blank_image, run_main, write_sst2
from test_debug_matrix import tiny_overrides

FAMILIES = {
    "gpt": "gpt_pydoc_char",
    "vit": "vit_fashion_mnist",
    "clip": "clip_fashion_mnist",
    "bert": "bert_pretrain_sst2",
    "sst2": "bert_finetune_sst2_scratch",
}


def assert_refused(status: int, out: str, *needles: str) -> None:
    assert status == 2, f"exit {status}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    for needle in needles:
        assert needle in out, f"{needle!r} not in:\n{out[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The last.ckpt of a two-step run of each family."""
    tmp = tmp_path_factory.mktemp("families")
    out = {}
    for family, experiment in FAMILIES.items():
        status, text = run_main(
            "train",
            [
                f"experiment={experiment}",
                f"task_name={family}",
                f"paths.root_dir={tmp}",
                *QUIET,
                "trainer.max_steps=2",
                "trainer.val_check_interval=2",
                "test=false",
                "sample=null",
                *tiny_overrides(experiment, tmp / family),
            ],
        )
        assert status == 0, text[-3000:]
        (out[family],) = (tmp / "logs" / family / "runs").glob("*/checkpoints/last.ckpt")
    return out


@pytest.mark.parametrize("family", ["clip", "bert", "gpt"])
def test_predict_refuses_a_checkpoint_that_is_not_an_image_classifier(runs, family, tmp_path):
    image = blank_image(tmp_path / "shoe.png")
    status, out = run_main("predict", [f"ckpt_path={runs[family]}", f"image={image}"])
    assert_refused(status, out, str(runs[family]), "attnlab-predict needs an image classifier")


@pytest.mark.parametrize(
    ("module", "args", "family"),
    [
        ("generate", ["prompt=a"], "vit"),
        ("fill-mask", ["text=a [MASK] ."], "gpt"),
        ("classify", ["text=good"], "bert"),
        ("zeroshot", ["labels=a,b", "split=null"], "vit"),
        ("translate", ["text=Hallo"], "gpt"),
    ],
)
def test_each_inference_cli_names_the_architecture_it_needs(runs, module, args, family, tmp_path):
    if module == "zeroshot":
        args = [*args, f"image={blank_image(tmp_path / 'x.png')}"]
    status, out = run_main(module, [f"ckpt_path={runs[family]}", *args])
    assert_refused(status, out, f"attnlab-{module} needs", "holds a")


@pytest.mark.parametrize(("experiment", "family"), [("vit_fashion_mnist", "gpt"), ("gpt_pydoc_char", "vit")])
def test_resuming_from_another_architecture_is_refused(runs, experiment, family, tmp_path):
    data = tiny_overrides(experiment, tmp_path)
    status, out = run_main(
        "train",
        [
            f"experiment={experiment}",
            f"ckpt_path={runs[family]}",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            *data,
        ],
    )
    assert_refused(status, out, "resume with the experiment that wrote it")


def test_fine_tuning_bert_from_a_gpt_checkpoint_is_refused(runs, tmp_path):
    status, out = run_main(
        "train",
        [
            "experiment=bert_finetune_sst2",
            f"data.source.data_dir={write_sst2(tmp_path / 'sst2')}",
            f"model.init_from={runs['gpt']}",
            f"paths.root_dir={tmp_path}",
            *QUIET,
        ],
    )
    assert_refused(
        status,
        out,
        "holds a LanguageModelTask (GPT)",
        "model.init_from needs a MaskedLMTask or TextClassificationTask run",
    )


@pytest.mark.parametrize(
    "module", ["eval", "generate", "translate", "predict", "fill-mask", "classify", "zeroshot"]
)
def test_every_inference_cli_asks_for_ckpt_path(module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blank_image(tmp_path / "x.png")
    args = {
        "translate": ["text=Hallo"],
        "predict": ["image=x.png"],
        "classify": ["text=good"],
        "zeroshot": ["image=x.png", "labels=a,b"],
    }.get(module, [])
    status, out = run_main(module, args)
    assert_refused(status, out, "ckpt_path is required")
    assert not list(tmp_path.glob("logs/eval/runs/*")), "attnlab-eval left a run folder behind"


def test_predict_asks_for_an_image(runs):
    status, out = run_main("predict", [f"ckpt_path={runs['vit']}"])
    assert_refused(status, out, "image is required")


def test_clip_pairs_asks_for_its_pairs_file(tmp_path):
    status, out = run_main("train", ["experiment=clip_pairs", f"paths.root_dir={tmp_path}", *QUIET])
    assert_refused(status, out, "data.source.path is required")


def test_the_right_checkpoint_still_serves_each_cli(runs, tmp_path):
    """The architecture check lets through what each CLI is for."""
    blank_image(tmp_path / "x.png")
    for module, family, args in [
        ("generate", "gpt", ["prompt=a", "max_new_tokens=3"]),
        ("fill-mask", "bert", ["text=the [MASK] ."]),
        ("classify", "sst2", ["text=good"]),
        ("predict", "vit", [f"image={tmp_path / 'x.png'}"]),
        ("zeroshot", "clip", [f"image={tmp_path / 'x.png'}", "labels=a,b", "split=null"]),
    ]:
        status, out = run_main(module, [f"ckpt_path={runs[family]}", *args])
        assert status == 0, f"{module}: {out[-3000:]}"


# ---- data and values that were accepted silently ---------------------------------------------------


@pytest.mark.parametrize("ratio", ["0", "-1"])
@pytest.mark.parametrize("experiment", ["vit_fashion_mnist", "swin_fashion_mnist"])
def test_a_non_positive_mlp_ratio_names_the_key(experiment, ratio, tmp_path):
    status, out = run_main(
        "train",
        [
            f"experiment={experiment}",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            *tiny_overrides(experiment, tmp_path),
            f"model.net.mlp_ratio={ratio}",
        ],
    )
    assert_refused(status, out, f"model.net.mlp_ratio={ratio}: must be greater than 0")


def test_classify_refuses_empty_text(runs):
    status, out = run_main("classify", [f"ckpt_path={runs['bert']}", "text="])
    assert_refused(status, out, "text='' is empty")


def fine_tune_with_label(tmp_path: Path, row: int, label: int, *extra: str) -> tuple[int, str]:
    """Fine-tune on the SST-2 lookalike with training row ``row`` (0: the header) labelled ``label``."""
    tiny = tiny_overrides("bert_finetune_sst2_scratch", tmp_path)  # writes the SST-2 lookalike
    train_file = tmp_path / "sst2" / "alps_train.tsv"
    rows = train_file.read_text().splitlines()
    rows[row] = rows[row].rsplit("\t", 1)[0] + f"\t{label}"
    train_file.write_text("\n".join(rows) + "\n")
    return run_main(
        "train",
        [
            "experiment=bert_finetune_sst2_scratch",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            *tiny[1:],
            f"data.source.data_dir={train_file.parent}",
            *extra,
        ],
    )


def test_a_stray_label_in_sst2_is_refused_with_its_line(tmp_path):
    status, out = fine_tune_with_label(tmp_path, 5, 2)
    assert_refused(status, out, "alps_train.tsv:6: label 2 is outside the 2 classes")


def test_a_label_gap_in_a_tsv_without_class_names_is_refused(tmp_path):
    status, out = fine_tune_with_label(tmp_path, 3, 5, "data.class_names=null")
    assert_refused(status, out, "leave out [2, 3, 4]", "line 4: 5")


def test_an_empty_class_folder_is_refused(tmp_path):
    from conftest import write_image_folder

    root = write_image_folder(tmp_path / "imgs")
    (root / "train" / "zebra").mkdir()
    status, out = run_main(
        "train",
        [
            "experiment=vit_fashion_mnist",
            "data=image_folder",
            f"data.source.path={root}",
            "data.img_size=16",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            *[
                o
                for o in tiny_overrides("vit_fashion_mnist", tmp_path)[1:]
                if not o.startswith("data.source.val_size")
            ],
        ],
    )
    assert_refused(status, out, "train/zebra: a class folder without images")


def test_a_training_set_smaller_than_one_batch_fails_instead_of_testing_an_untrained_model(tmp_path):
    from conftest import write_image_folder

    root = write_image_folder(tmp_path / "imgs", per_class=15)  # 30 images, batch 128, drop_last
    status, out = run_main(
        "train",
        [
            "experiment=vit_fashion_mnist",
            "data=image_folder",
            f"data.source.path={root}",
            "data.img_size=16",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            *[
                o
                for o in tiny_overrides("vit_fashion_mnist", tmp_path)[1:]
                if not o.startswith(("data.batch_size", "data.source.val_size"))
            ],
            "data.batch_size=128",
            "data.source.val_size=4",
        ],
    )
    assert_refused(status, out, "the training data gives no batch", "data.batch_size=128")
    assert not list(tmp_path.glob("logs/**/test_metrics*")) and "test/acc" not in out


# ---- disk faults: the path and the cause in one line, the last good checkpoint kept -------------

GPT_RUN = ["experiment=gpt_pydoc_char", *QUIET, *tiny_overrides("gpt_pydoc_char", Path("."))]


def test_an_unwritable_log_directory_is_one_line(tmp_path):
    (tmp_path / "a_file").touch()
    status, out = run_main("train", [*GPT_RUN, f"paths.root_dir={tmp_path / 'a_file'}"])
    assert_refused(
        status, out, f"cannot write the run folder {tmp_path / 'a_file' / 'logs'}", "Not a directory"
    )


def test_an_unwritable_checkpoint_directory_is_one_line(tmp_path):
    (tmp_path / "a_file").touch()
    status, out = run_main(
        "train",
        [
            *GPT_RUN,
            f"paths.root_dir={tmp_path}",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            f"callbacks.model_checkpoint.dirpath={tmp_path / 'a_file' / 'ckpt'}",
        ],
    )
    assert_refused(status, out, f"cannot write checkpoint {tmp_path / 'a_file' / 'ckpt'}", "Not a directory")
    assert ".tmp" not in out


def test_a_full_disk_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    import errno

    import torch
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    save, calls = TorchCheckpointIO.save_checkpoint, []

    def fills_up(self, checkpoint, path, storage_options=None):
        calls.append(path)
        if len(calls) > 2:  # the step-2 checkpoints (best and last) are written, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", fills_up)
    status, out = run_main(
        "train",
        [
            *GPT_RUN,
            f"paths.root_dir={tmp_path}",
            "trainer.max_steps=4",
            "trainer.val_check_interval=2",
            "task_name=full",
        ],
    )
    assert_refused(status, out, "No space left on device; the checkpoints written before are kept")
    (last,) = tmp_path.glob("logs/full/runs/*/checkpoints/last.ckpt")
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert not list(last.parent.glob(".*.tmp"))


def test_an_unwritable_output_file_is_one_line(runs, tmp_path):
    (tmp_path / "a_file").touch()
    out_file = tmp_path / "a_file" / "labels.tsv"
    status, out = run_main("classify", [f"ckpt_path={runs['sst2']}", "text=good", f"output={out_file}"])
    assert_refused(status, out, f"output={out_file}: cannot write it (File exists)")  # a file, not a folder
