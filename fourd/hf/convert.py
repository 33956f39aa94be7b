"""Convert Llama checkpoints between Hugging Face (config.json + safetensors) and fourd's format.

Tensors keep their dtype; q and k rows are permuted between Meta's interleaved rotary pairs and
Hugging Face's halves, exactly. Only safetensors are read. An export carries the run's tokenizer
file.

examples:
  fourd train --model debug --steps 20 --train.global_batch=4 --run-dir runs/demo  # a run
  fourd convert --from fourd runs/demo --to hf runs/demo-hf  # a run: its newest checkpoint
  fourd convert --from fourd runs/demo/checkpoints/step-20 --to hf runs/demo-hf-shards --shard-mb 1
  fourd convert --from hf runs/demo-hf --to fourd runs/demo-back
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fourd.ckpt import store
from fourd.data.corpus import read_regular
from fourd.data.tokenizer import load_tokenizer
from fourd.errors import FourdError
from fourd.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

ARCHITECTURE = "LlamaForCausalLM"
INDEX = "model.safetensors.index.json"
# config.json key -> ModelConfig field, both ways; LlamaConfig's defaults for keys a config.json
# omits.
_CONFIG = {
    "num_hidden_layers": "layers",
    "hidden_size": "dim",
    "intermediate_size": "ffn",
    "vocab_size": "vocab",
}
_CONFIG |= {
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "head_dim": "head_dim",
}
_CONFIG |= {
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "max_position_embeddings": "max_seq",
}
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048}
_IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",
)  # tensors some checkpoints carry that are recomputed, not learned
_TOKENIZER_FILES = {
    "tokenizer.json": "tokenizer.json",
    "tiktoken": "tokenizer.model",
}  # kind -> usual file name


def add_arguments(parser) -> None:
    add = parser.add_argument
    add("--from", dest="src_format", required=True, choices=("hf", "fourd"), help="format of SRC")
    add("src", metavar="SRC", help="directory to read (fourd: a checkpoint or a run directory)")
    add("--to", dest="dst_format", required=True, choices=("hf", "fourd"), help="format of DST")
    add("dst", metavar="DST", help="directory to create (must not exist)")
    add(
        "--shard-mb",
        type=int,
        default=5000,
        help="export: largest safetensors file in MB (default 5000)",
    )


def run(args) -> int:
    if args.shard_mb < 1:
        raise FourdError(f"--shard-mb {args.shard_mb} must be at least 1 (MB per safetensors file)")
    if (args.src_format, args.dst_format) == ("hf", "fourd"):
        cfg, _ = hf_to_fourd(args.src, args.dst)
    elif (args.src_format, args.dst_format) == ("fourd", "hf"):
        cfg = fourd_to_hf(args.src, args.dst, shard_bytes=args.shard_mb * 1_000_000)
    else:
        raise FourdError(
            f"--from {args.src_format} --to {args.dst_format}: convert between hf "
            "and fourd, one each way"
        )
    print(
        f"wrote {args.dst} ({args.dst_format}): {cfg.layers} layers, dim {cfg.dim}, "
        f"{cfg.params():,} parameters"
    )
    return 0


_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_TOP["output.weight"] = "lm_head.weight"
_BLOCK = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_BLOCK |= {f"attention.w{x}": f"self_attn.{x}_proj" for x in "qkvo"}
_BLOCK |= {
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
}


def hf_name(name: str) -> str:
    """fourd's (Meta's) parameter name -> Hugging Face's: layers.3.feed_forward.w1.weight ->
    model.layers.3.mlp..."""
    if name in _TOP:
        return _TOP[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{_BLOCK[rest.removesuffix('.weight')]}.weight"


def interleaved_to_halves(weight: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """Rows of a q or k projection, per head, from pairs (2i, 2i+1) to halves (i, i + d/2)
    (docs/hf.md)."""
    rows, cols = weight.shape
    half = rows // heads // 2
    if inverse:  # halves back to pairs
        shape = (heads, 2, half, cols)
    else:
        shape = (heads, half, 2, cols)
    return weight.reshape(shape).transpose(1, 2).reshape(rows, cols).contiguous()


def _rotary(cfg: ModelConfig, name: str, weight: torch.Tensor, inverse: bool) -> torch.Tensor:
    if name.endswith("wq.weight"):
        return interleaved_to_halves(weight, cfg.heads, inverse)
    if name.endswith("wk.weight"):
        return interleaved_to_halves(weight, cfg.kv_heads, inverse)
    return weight


def _json_object(path: Path, what: str) -> dict:
    try:
        obj = json.loads(read_regular(path, what, "give a Hugging Face model directory"))
    except (ValueError, RecursionError) as error:
        raise FourdError(f"{path}: not valid JSON ({str(error)[:80]})") from None
    if not isinstance(obj, dict):
        raise FourdError(f"{path}: not a JSON object; give a Hugging Face {what}")
    return obj


def _field(path: Path, hf: dict, key: str, default, kind: type):
    value: Any = hf.get(key)
    if value is None:
        value = default
    accepted: Any = (int, float)
    what = "number"
    if kind is int:
        accepted, what = int, "integer"
    valid = isinstance(value, accepted) and not isinstance(value, bool)
    if not valid or not math.isfinite(value) or value <= 0:
        raise FourdError(f"{path}: field {key!r} = {value!r} is not a positive {what}")
    return kind(value)


def read_hf_config(src: Path) -> tuple[ModelConfig, dict]:
    path = src / "config.json"
    hf = _json_object(path, "config.json")
    arch = hf.get("architectures") or [hf.get("model_type")]
    if not isinstance(arch, list) or not arch or (ARCHITECTURE not in arch and arch != ["llama"]):
        shown = arch
        if isinstance(arch, list) and arch:
            shown = arch[0]
        raise FourdError(
            f"{path}: architecture {shown!r} is not supported; fourd converts {ARCHITECTURE} only"
        )
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise FourdError(
                f"{path}: field {key!r} = {hf[key]!r} is not supported (fourd's Llama has {want!r})"
            )
    rope = hf.get("rope_parameters") or {}
    if (
        hf.get("rope_scaling")
        or not isinstance(rope, dict)
        or rope.get("rope_type", "default") != "default"
    ):
        what = f"'rope_parameters' = {rope!r}"
        if hf.get("rope_scaling"):
            what = f"'rope_scaling' = {hf['rope_scaling']!r}"
        raise FourdError(f"{path}: field {what} is not supported; fourd implements plain RoPE")
    given = {**hf, **rope}  # newer configs keep rope_theta in rope_parameters
    defaults = {**_HF_DEFAULTS, "num_key_value_heads": given.get("num_attention_heads")}
    values = {}
    for key, field in _CONFIG.items():
        if key == "head_dim" and given.get(key) is None:
            continue  # dim // heads
        kind: type = int
        if field in ("norm_eps", "rope_theta"):
            kind = float
        values[field] = _field(path, given, key, defaults.get(key), kind)
    return ModelConfig(**values), hf


def _safetensors_files(src: Path) -> list[Path]:
    if (src / INDEX).is_file():
        names = _json_object(src / INDEX, INDEX).get("weight_map")
        if not (
            isinstance(names, dict)
            and names
            and all(isinstance(file, str) for file in names.values())
        ):
            raise FourdError(f"{src / INDEX}: no valid 'weight_map'; the index is damaged")
        files = [store.inside(src, file, str(src / INDEX)) for file in sorted(set(names.values()))]
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        bins = sorted(path.name for path in src.glob("*.bin"))
        hint = ""
        if bins:
            hint = (
                f" ({bins[0]} is a pickle, which fourd does not load; save the model with "
                "safe_serialization)"
            )
        raise FourdError(f"{src}: no .safetensors files{hint}")
    for file in files:
        if not os.path.isfile(file):  # a FIFO or device would block or never end
            raise FourdError(f"{file}: missing or not a regular file (named in {INDEX})")
    return files


def read_hf_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(src):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for key in reader.keys():  # noqa: SIM118 - safe_open is not iterable
                    if key in tensors:
                        raise FourdError(f"{file}: tensor {key} also appears in another file")
                    tensors[key] = reader.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise FourdError(
                f"{file}: not a readable safetensors file ({str(error)[:80]})"
            ) from None
    return tensors


def hf_to_fourd_state_dict(
    cfg: ModelConfig, hf: dict, tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    tensors = {
        key: tensor for key, tensor in tensors.items() if not key.endswith(_IGNORED_SUFFIXES)
    }
    if (
        hf.get("tie_word_embeddings")
        and "lm_head.weight" not in tensors
        and "model.embed_tokens.weight" in tensors
    ):
        # Tied models (Llama 3.2 1B/3B) store one matrix; fourd's output projection gets its own
        # copy.
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    # checked before a model of that depth is built, even on the meta device
    if cfg.layers > len(tensors):
        raise FourdError(
            f"config.json says {cfg.layers} layers; the safetensors files hold "
            f"{len(tensors)} tensors"
        )
    state = {}
    for name, shape in store.shapes(cfg).items():
        hname = hf_name(name)
        if hname not in tensors:
            raise FourdError(
                f"tensor {hname} missing from the safetensors files (config.json implies it)"
            )
        weight = tensors.pop(hname)
        if tuple(weight.shape) != shape:
            raise FourdError(
                f"tensor {hname} has shape {list(weight.shape)}; config.json implies {list(shape)}"
            )
        state[name] = _rotary(cfg, name, weight, inverse=True)
    if extra := sorted(tensors):
        raise FourdError(
            f"tensor {extra[0]} is not part of a {ARCHITECTURE} ({len(extra)} "
            "unexpected); fourd would drop it"
        )
    return state


def read_hf(src: str | os.PathLike) -> tuple[ModelConfig, dict, dict[str, torch.Tensor]]:
    """A Hugging Face Llama directory: its ModelConfig, config.json, and tensors under fourd's
    names."""
    src = Path(src)
    if not src.is_dir():
        raise FourdError(f"{src}: not a directory; give a Hugging Face model directory")
    cfg, hf = read_hf_config(src)
    return cfg, hf, hf_to_fourd_state_dict(cfg, hf, read_hf_tensors(src))


def load_weights(
    path: str | os.PathLike, weights: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Hugging Face folder, a fourd checkpoint or a run directory (its newest): its ModelConfig
    and, with `weights`, its full state dict in fourd's names, float32 on the CPU (else {})."""
    where = Path(path)
    state: dict = {}
    if (where / "config.json").is_file() and weights:
        cfg, _, state = read_hf(where)
    elif (where / "config.json").is_file():
        cfg, _ = read_hf_config(where)
    elif not where.is_dir():
        raise FourdError(
            f"{path}: no such directory; give a fourd checkpoint, a run or a Hugging "
            "Face model directory"
        )
    elif weights:
        cfg, state = store.load_model_checkpoint(store.resolve(where))
    else:
        cfg = store.model_config(str(where), store.read_manifest(store.resolve(where))["model"])
    return cfg, {name: tensor.float() for name, tensor in state.items()}


def hf_to_fourd(
    src: str | os.PathLike, dst: str | os.PathLike
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg, hf, state = read_hf(src)
    store.save_model_checkpoint(dst, cfg, state, extra={"hf_config": hf})
    return cfg, state


def hf_config(cfg: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """config.json for `cfg`; `base` (the imported model's own config) keeps its other keys, e.g.
    token ids."""
    dtype_name = str(dtype).removeprefix("torch.")
    out = dict(base or {"bos_token_id": None, "eos_token_id": None})
    out.pop("rope_scaling", None)
    out |= {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
    }
    out |= {
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    out |= {key: getattr(cfg, field) for key, field in _CONFIG.items()}
    # Older readers take rope_theta at the top (above), newer ones from rope_parameters.
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return out


def _shard(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def tokenizer_spec(given: str | None, data: dict) -> str:
    if given is not None:
        return given
    return data.get("tokenizer") or "byte"


def run_tokenizer(manifest: dict, given: str | None):
    """The tokenizer the run trained with (byte-level when unrecorded); `given` must be the same
    one."""
    data = manifest.get("train", {}).get("data", {})
    tok = load_tokenizer(tokenizer_spec(given, data))
    if "identity" in data and tok.identity() != data["identity"]:
        if given is None:
            raise FourdError(
                f"tokenizer {data.get('tokenizer')!r} changed since the run "
                "trained with it; restore it"
            )
        raise FourdError(
            f"--tokenizer {given!r} is not the run's tokenizer "
            f"({data.get('tokenizer')!r}); leave it out"
        )
    return tok


def _tokenizer_file(manifest: dict) -> dict[str, bytes]:
    """{file name: bytes} of the tokenizer file the run trained with; {} for byte-level or
    unrecorded runs."""
    tok = run_tokenizer(manifest, None)
    if tok.name == "byte":
        return {}
    return {_TOKENIZER_FILES[tok.name]: tok.raw}


def write_hf(
    dst: Path, config: dict, tensors: dict[str, torch.Tensor], shard_bytes: int, extra=None
) -> None:
    """config.json, safetensors (sharded with an index past `shard_bytes`) and `extra` {name:
    bytes}, renamed into place at the end; every file gets the mode the umask gives (safetensors
    alone writes 0600)."""
    from safetensors.torch import save_file

    shards = _shard(tensors, shard_bytes)
    names = ["model.safetensors"]
    if len(shards) > 1:
        names = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
    files = {
        **(extra or {}),
        "config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(),
    }
    if len(shards) > 1:
        index = {
            "total_size": sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        }
        weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
        files[INDEX] = json.dumps({"metadata": index, "weight_map": weight_map}, indent=2).encode()
    umask = os.umask(0)
    os.umask(umask)
    with store.staged(dst) as tmp:
        for name, shard in zip(names, shards):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
        for name, content in files.items():
            (tmp / name).write_bytes(content)
        for path in tmp.iterdir():
            path.chmod(0o666 & ~umask)
        os.rename(tmp, dst)


def fourd_to_hf(
    src: str | os.PathLike, dst: str | os.PathLike, shard_bytes: int = 5_000_000_000
) -> ModelConfig:
    src = store.resolve(src)
    cfg, state = store.load_model_checkpoint(src)
    manifest = store.read_manifest(src)
    tensors = {
        hf_name(key): _rotary(cfg, key, tensor, inverse=False).contiguous()
        for key, tensor in state.items()
    }
    config = hf_config(cfg, state["tok_embeddings.weight"].dtype, manifest.get("hf_config"))
    write_hf(Path(dst), config, tensors, shard_bytes, extra=_tokenizer_file(manifest))
    return cfg
