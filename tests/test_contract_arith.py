"""Small formulas the contract rests on, against values worked out by hand (fast, one process):

- the exit status of a run whose workers returned (0, 128 + the stopping signal: 130, 143; a message: one
  line, status 1);
- the learning rate at every step of a short schedule (linear warm-up, then cosine to min_lr at the last step);
- the held-out split: training tokens, training windows, and the refusal of a corpus too small for one window;
- a checkpoint every interval and at the last step;
- MFU's FLOPs per token, 6·(N − input embedding) + 12·L·H·Q·T, for Llama 3 8B counted by hand.
"""

from __future__ import annotations

import math
import signal

import pytest

from fourd.config import Config
from fourd.data.dataset import split
from fourd.errors import FourdError, RunFailed
from fourd.model.config import get_preset
from fourd.train.launch import outcome
from fourd.train.step import lr_at
from fourd.train.worker import checkpoint_due


def test_exit_status_of_returned_workers():
    assert outcome([0, 0]) == 0
    assert outcome([signal.SIGINT, 0]) == 130
    assert outcome([0, signal.SIGTERM]) == 143
    assert outcome([signal.SIGINT, signal.SIGTERM]) == 143  # the highest signal any rank met
    with pytest.raises(RunFailed, match="^step 3: diverged$") as failed:
        outcome([0, "step 3: diverged"])
    assert failed.value.exit_code == 1


def test_learning_rate_at_every_step_of_a_short_schedule():
    cfg = Config()
    t = cfg.train
    t.steps, t.warmup_steps, t.lr, t.min_lr = 8, 3, 1.0, 0.1
    warm = [1 / 3, 2 / 3, 1.0]
    # steps 4..8: progress (s − 3) / 5, lr = 0.1 + 0.45 (1 + cos(π · progress))
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * (s - 3) / 5)) for s in range(4, 9)]
    got = [lr_at(s, cfg) for s in range(1, 9)]
    assert got == pytest.approx(warm + cosine, rel=1e-15)
    assert got[-1] == pytest.approx(0.1, rel=1e-15) and max(got) == 1.0
    t.warmup_steps = 0  # no warm-up: the first step already decays from lr
    assert lr_at(1, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 8)), rel=1e-15)


def test_held_out_split_exactly():
    # 1000 tokens, 10 % held out: the first 900 train, in (900 − 1) // 10 = 89 windows of 10 + 1 tokens
    assert split(1000, 10, 0.1) == (900, 89)
    assert split(1000, 10, 0.0) == (1000, 99)
    assert split(12, 11, 0.0) == (12, 1)  # exactly one window of 11 + 1 tokens
    with pytest.raises(FourdError) as refused:
        split(11, 11, 0.0)
    assert str(refused.value).startswith(
        "the corpus has 11 tokens, too few for one training sequence: 12 are needed "
    )
    with pytest.raises(FourdError) as refused:
        split(5, 4, 0.1)  # 6 tokens: int(6 × 0.9) = 5 = 4 + 1, and 5 would keep only 4
    assert "too few for one training sequence: 6 are needed (data.seq_len 4 + 1" in str(
        refused.value
    )


def test_a_checkpoint_every_interval_and_at_the_last_step():
    assert [step for step in range(1, 11) if checkpoint_due(step, 10, 4)] == [4, 8, 10]
    assert [step for step in range(1, 9) if checkpoint_due(step, 8, 4)] == [4, 8]
    assert [step for step in range(1, 6) if checkpoint_due(step, 5, 0)] == [5]  # none between
    assert [step for step in range(1, 4) if checkpoint_due(step, 3, 1)] == [1, 2, 3]


def test_mfu_counts_six_flops_a_parameter_but_the_input_embedding_and_twelve_l_h_q_t():
    """Llama 3 8B: 32 layers of dim 4,096 (32 query heads of 128, 8 KV heads), FFN 14,336, vocabulary
    128,256, untied output: 8,030,261,248 parameters (the released checkpoint's count)."""
    layers, dim, heads, head_dim, kv_dim, ffn, vocab, seq = (
        32,
        4096,
        32,
        128,
        1024,
        14336,
        128256,
        8192,
    )
    per_layer = (
        dim * dim + 2 * dim * kv_dim + dim * dim + 3 * dim * ffn + 2 * dim
    )  # Q K V O, SwiGLU, 2 norms
    params = (
        layers * per_layer + 2 * vocab * dim + dim
    )  # input embedding, output projection, final norm
    assert params == 8_030_261_248
    model = get_preset("llama3-8b")
    want = 6 * (params - vocab * dim) + 12 * layers * heads * head_dim * seq
    assert model.flops_per_token(seq) == want
    # full recomputation adds one forward of every layer (2 FLOPs a parameter, 4·H·Q·T of attention) for HFU
    assert model.flops_per_token(seq, "full") == want + layers * (
        2 * per_layer + 4 * heads * head_dim * seq
    )
