"""FP8 training's CUDA-only piece is torchao's conversion of linear layers (it needs an H100 or H200);
what fourd decides around it, which layers convert, is run here on CPU through the same function the
conversion is given (fourd.parallel.apply.fp8_converts)."""

import torch

from fourd.model.config import get_preset
from fourd.model.llama import build_model
from fourd.parallel.apply import fp8_converts
from fourd.parallel.pp import pipeline_split
from fourd.schedules import build_schedule

ATTENTION, MLP = ("wq", "wk", "wv", "wo"), ("w1", "w2", "w3")
BLOCK_LINEARS = [f"attention.{name}" for name in ATTENTION] + [
    f"feed_forward.{name}" for name in MLP
]


def _converted(module: torch.nn.Module) -> list[str]:
    return [fqn for fqn, sub in module.named_modules() if fp8_converts(sub, fqn)]


def test_fp8_converts_every_block_linear_and_keeps_the_output_projection_in_bf16():
    model = build_model(get_preset("debug"), seed=0, device="meta")
    linears = [fqn for fqn, sub in model.named_modules() if isinstance(sub, torch.nn.Linear)]
    assert "output" in linears
    want = [
        f"layers.{i}.{name}" for i in range(get_preset("debug").layers) for name in BLOCK_LINEARS
    ]
    assert sorted(_converted(model)) == sorted(want)
    assert not fp8_converts(model.norm, "norm") and not fp8_converts(model.tok_embeddings, "tok")


def test_fp8_keeps_the_last_pipeline_stages_output_projection_in_bf16():
    schedule = build_schedule("1f1b", 2, 2)
    first, last = (
        pipeline_split(get_preset("debug"), rank, schedule, device="meta")[0] for rank in (0, 1)
    )
    assert all(
        ".attention." in fqn or ".feed_forward." in fqn
        for fqn in _converted(first) + _converted(last)
    )
    assert (
        len(_converted(first)) + len(_converted(last))
        == len(BLOCK_LINEARS) * get_preset("debug").layers
    )
    assert isinstance(last.output, torch.nn.Linear) and "output" not in _converted(last)
