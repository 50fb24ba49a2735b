"""``model.optim.compile``: nothing, the whole net, or each repeated block (``regional``), in place, so
checkpoints keep their names; ``model.optim.compile_mode``: torch.compile's mode."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from attnlab.cli.common import compose_train
from attnlab.core.config import check_config, fill_missing
from attnlab.core.errors import ConfigError
from attnlab.training import LanguageModelTask
from attnlab.training.base import repeated_blocks
from attnlab.training.optim import Optimization
from conftest import VISION_NETS

GPT = ["experiment=gpt_pydoc_char", "data/source=pydoc", "model.net.depth=2", "model.net.n_head=2"]
GPT += ["model.net.dim=32", "model.net.max_len=16", "data.batch_size=4"]
NETS = {  # a net with blocks of each kind regional compiles, and what the data fills in
    "gpt": (GPT, {"vocab_size": 50}),
    "vit": (
        ["experiment=vit_fashion_mnist", *VISION_NETS["vit"][:-1], "model.net.depth=2"],
        {"num_classes": 10, "img_size": 28, "in_chans": 1},
    ),
}


def build(kind: str, tmp_path, *overrides: str) -> L.LightningModule:
    args, filled = NETS[kind]
    cfg = compose_train([*args, f"paths.output_dir={tmp_path}", *overrides])
    fill_missing(cfg.model.net, filled, "model.net")
    torch.manual_seed(0)
    return instantiate(cfg.model)


@pytest.mark.parametrize("kind", ["gpt", "vit"])
def test_regional_compiles_each_block_in_place_and_checkpoints_keep_their_names(kind, tmp_path):
    regional = build(kind, tmp_path, "model.optim.compile=regional")
    regional.setup("fit")
    eager = build(kind, tmp_path, "model.optim.compile=false")
    eager.setup("fit")
    blocks = regional.net.blocks
    assert len(blocks) == 2 and repeated_blocks(regional.net) == list(blocks)
    assert all(block._compiled_call_impl is not None for block in blocks)
    assert regional.net._compiled_call_impl is None  # the blocks only, not the whole net
    assert all(block._compiled_call_impl is None for block in eager.net.blocks)
    assert list(regional.state_dict()) == list(eager.state_dict())
    assert not any("_orig_mod" in key for key in regional.state_dict())
    regional.load_state_dict(eager.state_dict())  # and the other way round
    eager.load_state_dict(regional.state_dict())


def test_regional_finds_the_innermost_lists_of_blocks():
    from attnlab.models import SwinTransformer

    swin = SwinTransformer(10, 32, 1, 2, 8, [2, 2], [1, 2], 4)
    names = {id(m): name for name, m in swin.named_modules()}
    found = [names[id(m)] for m in repeated_blocks(swin)]
    assert found == ["layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0", "layers.1.blocks.1"]
    stem = nn.Sequential(nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), nn.Sequential(nn.Conv2d(2, 2, 3)))
    assert repeated_blocks(nn.ModuleDict({"convs": stem})) == []  # conv runs are no blocks


def test_compile_values_are_checked_in_one_line(tmp_path):
    def check(*overrides: str) -> None:
        check_config(compose_train([*GPT, f"paths.output_dir={tmp_path}", *overrides]))

    with pytest.raises(ConfigError, match=r"^model\.optim\.compile='regionl': .*'regional'"):
        check("model.optim.compile=regionl")
    with pytest.raises(
        ConfigError, match=r"^model\.optim\.compile_mode='fast': .*'default', 'reduce-overhead'"
    ):
        check("model.optim.compile=true", "model.optim.compile_mode=fast")
    check("model.optim.compile=regional", "model.optim.compile_mode=reduce-overhead")
    with pytest.raises(ConfigError, match=r"^model\.optim\.compile_mode=reduce-overhead compiles nothing"):
        Optimization(torch.optim.AdamW, compile_mode="reduce-overhead")
    no_blocks = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))
    with pytest.raises(
        ConfigError, match=r"^model\.optim\.compile=regional: Sequential has no repeated blocks"
    ):
        LanguageModelTask(no_blocks, Optimization(torch.optim.AdamW, compile="regional"))


def fit_tiny(model: L.LightningModule, tmp_path) -> L.LightningModule:
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (8, 17))
    data = torch.utils.data.DataLoader(list(zip(tokens[:, :-1], tokens[:, 1:], strict=True)), batch_size=4)
    trainer = L.Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data)
    return model


def test_regional_training_compiles_one_code_for_every_block(tmp_path):
    """Two blocks, one graph: dynamo reuses the first block's compiled code for the second; the
    weights trained compiled equal the eager ones' (to inductor's rounding), under the same names."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    regional = fit_tiny(build("gpt", tmp_path, "model.optim.compile=regional"), tmp_path)
    assert counters["stats"]["unique_graphs"] == 1
    eager = fit_tiny(build("gpt", tmp_path, "model.optim.compile=false"), tmp_path)
    compiled_state, eager_state = regional.state_dict(), eager.state_dict()
    assert list(compiled_state) == list(eager_state)
    for key, value in eager_state.items():
        torch.testing.assert_close(compiled_state[key], value, atol=1e-4, rtol=1e-4)
