"""Data parallelism: token-budget batches sharded over processes, and a multirun under
`trainer=ddp_cpu` (whole two-process runs of each family are in test_scaleout.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from hydra.utils import instantiate
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.trainer.states import RunningStage
from omegaconf import OmegaConf
from torchmetrics.text import SacreBLEUScore
from torchmetrics.utilities.data import dim_zero_sum

from attnlab.cli.common import compose_train
from attnlab.core.errors import DataError
from attnlab.data.batching import RepeatedBatch, TokenBatchSampler
from attnlab.data.sources import Generated
from attnlab.data.text.translation import TranslationDataModule, synthetic_pairs
from conftest import assert_ok, read_metrics, run_cli, tiny
from test_debug_matrix import tiny_overrides

LENGTHS = [(i * 7919) % 40 + 1 for i in range(500)]  # 1..40 tokens, every length many times


def shards(
    world: int,
    shuffle: bool,
    lengths: list[int] = LENGTHS,
    max_tokens: int = 200,
    seed: int = 3,
    epoch: int = 0,
) -> list[list[list[int]]]:
    out = []
    for rank in range(world):
        sampler = TokenBatchSampler(lengths, max_tokens, shuffle, seed=seed, num_replicas=world, rank=rank)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


# -- the sampler -----------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
def test_training_shards_are_disjoint_equal_and_cover_every_pair(world):
    parts = shards(world, shuffle=True)
    assert len({len(p) for p in parts}) == 1  # equal step counts: DDP never waits on a missing step
    everyone = TokenBatchSampler(LENGTHS, 200, True, seed=3).global_batches()
    assert sorted(i for b in everyone for i in b) == list(range(len(LENGTHS)))
    padding = -len(everyone) % world
    assert padding < world
    # together the processes take every batch once, plus the first `padding` batches again
    taken = sorted(tuple(b) for p in parts for b in p)
    assert taken == sorted(tuple(b) for b in everyone + everyone[:padding])
    assert all(not isinstance(b, RepeatedBatch) for p in parts for b in p)  # repeats train too


@pytest.mark.parametrize("world", [1, 2, 3])
def test_evaluation_shards_score_every_pair_exactly_once_in_length_order(world):
    for lengths in (LENGTHS, LENGTHS[:7]):  # (7 short pairs fit one batch: it is halved to share)
        parts = shards(world, shuffle=False, lengths=lengths)
        assert len({len(p) for p in parts}) == 1
        taken = sorted(i for p in parts for b in p for i in b)
        assert taken == list(range(len(lengths)))  # no repeats, none missing
        for p in parts:  # not shuffled: each process goes from short to long
            longest = [max(lengths[i] for i in b) for b in p]
            assert longest == sorted(longest)
    assert shards(world, shuffle=False) == shards(world, shuffle=False, epoch=5, seed=9)


def test_evaluation_with_fewer_pairs_than_processes_pads_with_marked_repeats():
    parts = shards(3, shuffle=False, lengths=[5, 6])
    assert [len(p) for p in parts] == [1, 1, 1]
    scored = [b for p in parts for b in p if not isinstance(b, RepeatedBatch)]
    assert sorted(i for b in scored for i in b) == [0, 1]


def examples(batch) -> list[tuple]:
    """The examples of a batch, each as a tuple of its rows (padding cut), whatever the batching."""
    if isinstance(batch, dict):
        keys = [k for k in ("ids", "segments", "mlm_labels", "nsp_labels", "labels") if k in batch]
        lengths = (batch["ids"] != 0).sum(1).tolist()
        return [
            tuple(tuple(batch[k][i][:n].tolist()) if batch[k].dim() > 1 else batch[k][i].item() for k in keys)
            for i, n in enumerate(lengths)
        ]
    return [tuple(tuple(t[i].flatten().tolist()) for t in batch) for i in range(len(batch[0]))]


def eval_loaders(dm, stage: str) -> list:
    loaders = dm.val_dataloader() if stage == "val" else dm.test_dataloader()
    return loaders if isinstance(loaders, list) else [loaders]


@pytest.mark.parametrize(
    "experiment", ["vit_fashion_mnist", "clip_fashion_mnist", "gpt_pydoc_char", "bert_pretrain_sst2"]
)
def test_evaluation_splits_are_shared_out_without_repeats_in_every_family(experiment, tmp_path):
    """Under DDP every process must run as many evaluation steps and every example must be scored
    once: Lightning's DistributedSampler pads a split with copies instead, counted twice."""
    cfg = compose_train(
        [f"experiment={experiment}", *tiny_overrides(experiment, tmp_path), f"paths.root_dir={tmp_path}"]
    )
    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    for stage in ("val", "test"):
        dm.rank_world = lambda: (0, 1)
        one = [[e for b in loader for e in examples(b)] for loader in eval_loaders(dm, stage)]
        assert all(len(x) % 6 for x in one[:1]), "a split that divides by 2 and 3 tests nothing"
        for world in (2, 3):
            parts = []
            for rank in range(world):
                dm.rank_world = lambda rank=rank, world=world: (rank, world)
                parts.append([list(loader) for loader in eval_loaders(dm, stage)])
            for k, whole in enumerate(one):
                assert len({len(p[k]) for p in parts}) == 1, "processes with different step counts"
                shared = [e for p in parts for b in p[k] for e in examples(b)]
                assert sorted(shared) == sorted(whole), f"{stage} loader {k}, {world} processes"


def test_an_evaluation_split_smaller_than_the_processes_is_refused(tmp_path):
    cfg = compose_train(["experiment=vit_fashion_mnist", *tiny_overrides("vit_fashion_mnist", tmp_path)])
    dm = instantiate(cfg.data)
    dm.setup("fit")
    dm.rank_world = lambda: (0, len(dm.splits["val"]) + 1)
    with pytest.raises(DataError, match="the val split has .* examples, fewer than the .* processes"):
        dm.val_dataloader()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_batches_are_reshuffled_each_epoch_and_reproducible_from_the_seed(world):
    first = shards(world, shuffle=True)
    assert shards(world, shuffle=True) == first
    assert shards(world, shuffle=True, epoch=1) != first
    assert shards(world, shuffle=True, seed=4) != first
    for shuffle in (True, False):
        for p in shards(world, shuffle=shuffle, epoch=2):
            assert all(len(b) * max(LENGTHS[i] for i in b) <= 200 for b in p)


def synthetic_translation(tmp_path: Path, pairs: int, eval_max_tokens: int) -> TranslationDataModule:
    """A set-up DataModule of ``pairs`` synthetic pairs, batches of at most 64 tokens."""
    dm = TranslationDataModule(
        source=Generated("synthetic", train_size=pairs, cache_dir=str(tmp_path)),
        vocab_size=200,
        max_len=40,
        max_tokens=64,
        eval_max_tokens=eval_max_tokens,
    )
    dm.setup()
    return dm


def test_lightning_keeps_the_sampler_and_sets_its_epoch(tmp_path):
    """Under DDP Lightning replaces a loader's sampler with its DistributedSampler unless the
    sampler is one already; and it calls set_epoch only on ``loader.sampler`` (or
    ``loader.batch_sampler.sampler``), never on a custom batch sampler."""
    dm = synthetic_translation(tmp_path, 100, eval_max_tokens=64)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    assert trainer._accelerator_connector.is_distributed
    dm.trainer = SimpleNamespace(global_rank=1, world_size=2)
    loader = dm.train_dataloader()
    connector = trainer._data_connector
    assert not connector._requires_distributed_sampler(loader)
    assert connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING) is loader
    assert loader.sampler.rank == 1 and loader.sampler.num_replicas == 2
    before = [b["idx"].tolist() for b in loader]
    _set_sampler_epoch(loader, 1)  # what the fit loop calls at the start of each epoch
    assert loader.sampler.epoch == 1 and [b["idx"].tolist() for b in loader] != before


def test_overfit_batches_swaps_in_a_sequential_sampler_of_the_first_batches(tmp_path):
    """``trainer.overfit_batches`` (``debug=overfit``) replaces the loader's sampler with a
    ``SequentialSampler`` over the dataset, which yields batch numbers: the loader must then give
    the sampler's batches of epoch 0, in order, every epoch."""
    from lightning.pytorch.trainer.connectors.data_connector import _resolve_overfit_batches
    from lightning.pytorch.utilities import CombinedLoader

    dm = synthetic_translation(tmp_path, 100, eval_max_tokens=64)
    loader = dm.train_dataloader()
    first = [b["idx"].tolist() for b in loader]
    combined = CombinedLoader(loader)
    with pytest.warns(UserWarning, match="overfit"):
        _resolve_overfit_batches(combined, RunningStage.TRAINING)
    (swapped,) = combined.flattened
    assert type(swapped.sampler).__name__ == "SequentialSampler"
    assert [b["idx"].tolist() for b in swapped] == first
    _set_sampler_epoch(swapped, 1)  # a SequentialSampler has no epoch: the same batches again
    assert [b["idx"].tolist() for b in swapped] == first


def test_the_datamodule_shards_by_the_trainers_rank(tmp_path):
    dm = synthetic_translation(tmp_path, 300, eval_max_tokens=128)
    train, val = [], []
    for rank in range(2):
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        train.append([b["idx"].tolist() for b in dm.train_dataloader()])
        val.append([b["idx"].tolist() for b in dm.val_dataloader() if not b["repeat"]])
    assert len(train[0]) == len(train[1]) and len(val[0]) == len(val[1])
    n_val = len(dm.splits["val"])
    assert sorted(i for v in val for b in v for i in b) == list(range(n_val))
    assert {i for b in train[0] for i in b} | {i for b in train[1] for i in b} == set(range(300))
    dm.trainer = None  # no trainer, no process group: the whole split
    assert sorted(i for b in dm.val_dataloader() for i in b["idx"].tolist()) == list(range(n_val))


def test_bleu_of_shards_merged_is_the_bleu_of_the_whole():
    """What DDP does to the metric at compute(): its states (n-gram counts, lengths) are summed over
    the processes, so BLEU of the merged halves is corpus BLEU, not an average of two BLEUs."""
    src, refs = synthetic_pairs(40, seed=5)
    hyps = [" ".join(r.split()[: 1 + i % 4]) + "." for i, r in enumerate(refs)]  # partly right
    whole, halves = SacreBLEUScore(), [SacreBLEUScore(), SacreBLEUScore()]
    whole.update(hyps, [[r] for r in refs])
    for k, half in enumerate(halves):
        half.update(hyps[k::2], [[r] for r in refs[k::2]])
    assert all(fx is dim_zero_sum for fx in whole._reductions.values())  # how DDP merges them
    for name in whole._defaults:  # what the sync does: gather every process's state, then sum
        setattr(halves[0], name, getattr(halves[0], name) + getattr(halves[1], name))
    assert 0 < float(whole.compute()) < 1
    assert float(halves[0].compute()) == pytest.approx(float(whole.compute()), abs=1e-6)


# -- trainer=ddp_cpu end to end: whole runs of each family in test_scaleout.py ---------------------
GPT = [
    *tiny("trainer.max_steps=30", "model.optim.optimizer.lr=3e-3", "model.optim.scheduler.warmup_steps=5"),
    "logger=csv",
]


def test_a_multirun_with_ddp_trains_each_job_once_in_its_own_directory(tmp_path):
    """Lightning relaunches rank 1 from the command line; in a multirun that line still held ``-m``
    and both values, so rank 1 ran a sweep of its own elsewhere (lightning-hydra-template #393)."""
    proc = run_cli(
        "train",
        [
            "-m",
            *GPT,
            "trainer=ddp_cpu",
            "trainer.max_steps=10",
            "task_name=sweep_ddp",
            "model.optim.optimizer.lr=1e-3,3e-3",
        ],
        tmp_path,
    )
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert out.count("Launching 2 jobs locally") == 1
    task_dir = tmp_path / "logs" / "sweep_ddp"
    (sweep_dir,) = (task_dir / "multiruns").iterdir()
    assert sorted(p.name for p in task_dir.iterdir()) == ["multiruns"]  # no run directory of a rank
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    for job, lr in (("0", 1e-3), ("1", 3e-3)):
        job_dir = sweep_dir / job
        log = (job_dir / "sweep_ddp.log").read_text()
        assert log.count("Instantiating model") == 2  # rank 0 and rank 1, both here
        assert OmegaConf.load(job_dir / "config.yaml").model.optim.optimizer.lr == lr
        assert OmegaConf.load(job_dir / "run.yaml").seeds.ranks == [1337, 1338]  # seed + rank
        assert len(read_metrics(job_dir)["val/loss"]) == 1
