"""Model dimensions and presets, in pure Python so that the planner can read them without torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from fourd.errors import FourdError

# the MLPs a model spec names: Llama's SwiGLU (what fourd trains), and for the planner GPT's GeLU MLP
MLPS = ("swiglu", "gelu", "gelu_new")
# the ModelConfig fields only the planner sets: fourd trains a Llama (SwiGLU) with its own output
# projection, so a run's [model] section and --init-from leave these at their defaults
PLANNER_ONLY_FIELDS = ("mlp", "tied_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape: what fourd trains (a Llama, `mlp` "swiglu") and what the
    planner plans (any of MLPS)."""

    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 0  # 0: dim // heads
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    max_seq: int = 8192
    # "swiglu" (Llama), or for the planner only a GPT-style MLP: "gelu" (one GeLU kernel), or
    # "gelu_new" (GPT-2's tanh approximation as Hugging Face's NewGELUActivation runs it, eight ops)
    mlp: str = "swiglu"
    # for the planner only: the output projection is the input embedding's matrix (GPT-2, Megatron's
    # GPT, MPT, BLOOM, Llama 3.2 1B and 3B), held once where one stage holds both; fourd trains
    # untied (`fourd convert` copies a tied matrix into its own output projection)
    tied_embeddings: bool = False

    def __post_init__(self):
        for field in ("layers", "dim", "ffn", "heads", "kv_heads", "vocab", "head_dim"):
            value = getattr(self, field)
            if field == "head_dim" and not value:
                value = self.dim // self.heads
                object.__setattr__(self, "head_dim", value)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FourdError(f"model.{field} = {value!r} must be a positive integer")
        if self.heads % self.kv_heads:
            raise FourdError(
                f"model.heads = {self.heads} must be a multiple of model.kv_heads = {self.kv_heads}"
            )
        if self.head_dim % 2:
            raise FourdError(f"model head_dim = {self.head_dim} must be even for RoPE")
        if self.mlp not in MLPS:
            raise FourdError(f"model.mlp = {self.mlp!r}: allowed values are {', '.join(MLPS)}")
        if not isinstance(self.tied_embeddings, bool):
            raise FourdError(
                f"model.tied_embeddings = {self.tied_embeddings!r} must be true or false"
            )

    # Parameter counts, exactly as the torch model allocates them (tested against it on the meta
    # device).
    def layer_matrix_params(self) -> int:
        """A layer's weight matrices: the attention's four, and w1, w2, w3 (SwiGLU) or two (GeLU)."""
        query = self.dim * self.heads * self.head_dim
        key_value = 2 * self.dim * self.kv_heads * self.head_dim
        out = self.heads * self.head_dim * self.dim
        mlp_matrices = 3 if self.mlp == "swiglu" else 2
        return query + key_value + out + mlp_matrices * self.dim * self.ffn

    def layer_params(self) -> int:
        """The matrices and the norms: two RMSNorm weights, or two LayerNorms with a bias each."""
        norms = 2 * self.dim if self.mlp == "swiglu" else 4 * self.dim
        return self.layer_matrix_params() + norms

    def embedding_params(self) -> int:
        """The input embedding's matrix; the output projection's is the same size."""
        return self.vocab * self.dim

    def final_norm_params(self) -> int:
        """A LayerNorm's weight and bias, or an RMSNorm's weight (SwiGLU, Llama)."""
        if self.mlp == "swiglu":
            return self.dim
        return 2 * self.dim

    def params(self) -> int:
        """Every parameter once: the layers, the final norm, the input embedding, and the output
        projection unless it is the embedding's matrix (tied)."""
        matrices = 1 if self.tied_embeddings else 2
        return self.non_embedding_params() + matrices * self.embedding_params()

    def non_embedding_params(self) -> int:
        return self.layers * self.layer_params() + self.final_norm_params()

    def flops_per_token(self, seq: int, recompute: str = "none") -> float:
        """FLOPs per trained token for MFU, 6·(N − input embedding) + 12·L·H·Q·T (PaLM, Chowdhery et
        al. 2022, app. B), N counting the output projection whether or not it is tied (its matmul
        runs either way); with `recompute` "full" the hardware's for HFU, one more forward per
        layer (docs/parallelism.md)."""
        attention = self.attention_flops_per_token(seq)
        model = 6 * (self.non_embedding_params() + self.embedding_params()) + attention
        if recompute == "full":
            forward = self.attention_forward_flops_per_token(seq)
            return model + 2 * self.layers * self.layer_params() + forward
        return model

    def attention_forward_flops_per_token(self, seq: int) -> int:
        """The attention core's forward FLOPs a token, all layers: QKᵀ and the weighted sum of V
        over every pair of the sequence, 4·L·H·Q·T (PaLM, Chowdhery et al. 2022, app. B)."""
        return 4 * self.layers * self.heads * self.head_dim * seq

    def attention_flops_per_token(self, seq: int) -> int:
        """The attention core's share of flops_per_token, 12·L·H·Q·T: its forward and a backward of
        twice the forward's FLOPs."""
        return 3 * self.attention_forward_flops_per_token(seq)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # Runs in seconds: the test suite's model.
    "debug": ModelConfig(layers=4, dim=64, ffn=176, heads=4, kv_heads=2, vocab=256, max_seq=256),
    # `make run`: trains visibly in a few minutes on 2 CPU cores (byte-level vocabulary).
    "small": ModelConfig(layers=8, dim=256, ffn=704, heads=8, kv_heads=4, vocab=256, max_seq=1024),
    # Llama 3 paper, Table 3, and the released configs.
    "llama3-8b": ModelConfig(layers=32, dim=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
    "llama3-70b": ModelConfig(layers=80, dim=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256),
    "llama3-405b": ModelConfig(
        layers=126, dim=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256
    ),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise FourdError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


_SPEC_KEYS = {"layers", "dim", "ffn", "heads", "kv_heads", "vocab", "mlp", "head_dim", "tied"}


def parse_model_spec(spec: str) -> ModelConfig:
    """`layers=126,dim=16384,ffn=53248,heads=128,kv_heads=8,vocab=128256[,mlp=gelu|gelu_new]
    [,tied=1]` (tied=1: the output projection is the input embedding's matrix)."""
    values: dict[str, object] = {}
    for part in filter(None, (item.strip() for item in spec.split(","))):
        key, sep, val = part.partition("=")
        if not sep or key not in _SPEC_KEYS:
            raise FourdError(
                f"--model-spec: bad item {part!r}; keys are "
                f"{', '.join(sorted(_SPEC_KEYS))} as key=value"
            )
        if key in values:
            raise FourdError(f"--model-spec: {key} is given twice; give each key once")
        if key == "mlp":
            values[key] = val
        elif key == "tied":
            if val not in ("0", "1"):
                raise FourdError(f"--model-spec: tied={val!r} must be 1 (tied) or 0 (untied)")
            values["tied_embeddings"] = val == "1"
        else:
            try:
                number = int(val)
            except ValueError:
                raise FourdError(f"--model-spec: {key}={val!r} must be an integer") from None
            values[key] = number
            if number < 1:
                raise FourdError(f"--model-spec: {key}={val} must be a positive integer")
    missing = {"layers", "dim", "ffn", "heads", "vocab"} - values.keys()
    if missing:
        raise FourdError(f"--model-spec lacks {', '.join(sorted(missing))}")
    values.setdefault("kv_heads", values["heads"])
    return ModelConfig(**values)  # type: ignore[arg-type]


def with_overrides(cfg: ModelConfig, **fields) -> ModelConfig:
    """`cfg` with fields replaced; head_dim follows a new dim or heads unless it is given too."""
    if ("dim" in fields or "heads" in fields) and "head_dim" not in fields:
        fields["head_dim"] = 0  # recomputed as dim // heads
    return replace(cfg, **fields)
