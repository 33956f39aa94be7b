"""Convert Llama checkpoints between Hugging Face (config.json + safetensors) and fourd's format.

    fourd convert --from hf ./Llama-3-8B --to fourd ./ckpt/llama3-8b
    fourd convert --from fourd ./run/checkpoints/step-1000 --to hf ./export --shard-mb 5000

Tensors keep their dtype (a bfloat16 model stays bfloat16). Hugging Face stores q and k with the
rotary pairs split into halves; fourd keeps Meta's interleaved pairs, and the conversion permutes
those rows exactly (no arithmetic). Only safetensors are read: pickled .bin files are refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from fourd.ckpt import store
from fourd.errors import FourdError
from fourd.model.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
INDEX = "model.safetensors.index.json"
# LlamaConfig's defaults, for a config.json that omits the key.
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048}
# Tensors Hugging Face checkpoints sometimes carry that are recomputed, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def add_arguments(p) -> None:
    p.add_argument("--from", dest="src_format", required=True, choices=("hf", "fourd"), help="format of SRC")
    p.add_argument("src", metavar="SRC", help="directory to read")
    p.add_argument("--to", dest="dst_format", required=True, choices=("hf", "fourd"), help="format of DST")
    p.add_argument("dst", metavar="DST", help="directory to create (must not exist)")
    p.add_argument(
        "--shard-mb",
        type=int,
        default=5000,
        help="Hugging Face export: largest safetensors file in MB; more becomes shards plus an index",
    )


def run(args) -> int:
    if (args.src_format, args.dst_format) == ("hf", "fourd"):
        cfg, _ = hf_to_fourd(args.src, args.dst)
    elif (args.src_format, args.dst_format) == ("fourd", "hf"):
        cfg = fourd_to_hf(args.src, args.dst, shard_bytes=args.shard_mb * 1_000_000)
    else:
        raise FourdError(f"--from {args.src_format} --to {args.dst_format}: convert between hf and fourd, one each way")
    print(f"wrote {args.dst} ({args.dst_format}): {cfg.layers} layers, dim {cfg.dim}, {cfg.params():,} parameters")
    return 0


# ---- names and the rotary layout -------------------------------------------------------------------

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
}


def hf_name(name: str) -> str:
    """fourd (Meta) parameter name -> Hugging Face name, e.g. layers.3.feed_forward.w1.weight ->
    model.layers.3.mlp.gate_proj.weight."""
    if name in _TOP:
        return _TOP[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{_BLOCK[rest.removesuffix('.weight')]}.weight"


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Every fourd parameter name of `cfg` -> its Hugging Face name."""
    return {name: hf_name(name) for name in _shapes(cfg)}


def interleaved_to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection, per head, from pairs (2i, 2i+1) to halves (i, i + d/2).

    Meta rotates x[2i] with x[2i+1]; Hugging Face rotates x[i] with x[i + d/2]. Moving output rows
    this way gives the same attention scores, since q·k is a sum over all rows alike.
    """
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def halves_to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of interleaved_to_halves."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from fourd.model.llama import build_model

    return {k: tuple(v.shape) for k, v in build_model(cfg, device="meta").state_dict().items()}


# ---- Hugging Face -> fourd -------------------------------------------------------------------------


def read_hf_config(src: Path) -> tuple[ModelConfig, dict]:
    path = src / "config.json"
    if not path.is_file():
        raise FourdError(f"{src}: no config.json; give a Hugging Face model directory")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FourdError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise FourdError(f"{path}: not a JSON object; give a Hugging Face config.json")
    arch = hf.get("architectures") or [hf.get("model_type")]
    if ARCHITECTURE not in arch and arch != ["llama"]:
        raise FourdError(f"{path}: architecture {arch[0]!r} is not supported; fourd converts {ARCHITECTURE} only")

    def integer(key, default=None):
        value = hf.get(key) if hf.get(key) is not None else default
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise FourdError(f"{path}: field {key!r} missing or not a positive integer")
        return value

    def number(key, value):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise FourdError(f"{path}: field {key!r} = {value!r} is not a number")
        return float(value)

    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, want) != want:
            raise FourdError(f"{path}: field {key!r} = {hf[key]!r} is not supported (fourd's Llama has {want!r})")
    rope = hf.get("rope_parameters") or {}
    if hf.get("rope_scaling"):
        raise FourdError(
            f"{path}: field 'rope_scaling' = {hf['rope_scaling']!r} is not supported; fourd implements plain RoPE"
        )
    if rope.get("rope_type", "default") != "default":
        raise FourdError(
            f"{path}: field 'rope_parameters.rope_type' = {rope['rope_type']!r} is not supported; "
            "fourd implements plain RoPE"
        )
    dim, heads = integer("hidden_size"), integer("num_attention_heads")
    cfg = ModelConfig(
        layers=integer("num_hidden_layers"),
        dim=dim,
        ffn=integer("intermediate_size"),
        heads=heads,
        kv_heads=integer("num_key_value_heads", heads),
        vocab=integer("vocab_size"),
        head_dim=integer("head_dim", dim // heads),
        norm_eps=number("rms_norm_eps", hf.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])),
        rope_theta=number("rope_theta", rope.get("rope_theta", hf.get("rope_theta", _HF_DEFAULTS["rope_theta"]))),
        max_seq=integer("max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]),
    )
    return cfg, hf


def _safetensors_files(src: Path) -> list[Path]:
    index = src / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise FourdError(f"{index}: no valid 'weight_map'; the index is damaged") from None
        files = [src / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FourdError(f"{f}: missing (named in {INDEX})")
        return files
    files = sorted(src.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in src.glob("*.bin"))
        hint = (
            f" ({bins[0]} is a pickle, which fourd does not load; save the model with safe_serialization)"
            if bins
            else ""
        )
        raise FourdError(f"{src}: no .safetensors files{hint}")
    return files


def read_hf_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(src):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():  # noqa: SIM118 - safe_open is not iterable
                    if k in tensors:
                        raise FourdError(f"{f}: tensor {k} also appears in another file")
                    tensors[k] = st.get_tensor(k)
        except SafetensorError as e:
            raise FourdError(f"{f}: not a valid safetensors file ({e})") from None
    return tensors


def hf_to_fourd_state_dict(cfg: ModelConfig, hf: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if hf.get("tie_word_embeddings") and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        # Tied models (Llama 3.2 1B/3B) store one matrix; fourd's output projection gets its own copy.
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    shapes, names = _shapes(cfg), hf_names(cfg)
    sd = {}
    for name, hname in names.items():
        if hname not in tensors:
            raise FourdError(f"tensor {hname} missing from the safetensors files (config.json implies it)")
        w = tensors.pop(hname)
        if tuple(w.shape) != shapes[name]:
            raise FourdError(f"tensor {hname} has shape {list(w.shape)}; config.json implies {list(shapes[name])}")
        if name.endswith(("wq.weight", "wk.weight")):
            w = halves_to_interleaved(w, cfg.heads if name.endswith("wq.weight") else cfg.kv_heads)
        sd[name] = w
    if tensors:
        raise FourdError(
            f"tensor {sorted(tensors)[0]} is not part of a {ARCHITECTURE} "
            f"({len(tensors)} unexpected tensor(s)); fourd would drop it"
        )
    return sd


def hf_to_fourd(src: str | os.PathLike, dst: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    src = Path(src)
    if not src.is_dir():
        raise FourdError(f"{src}: not a directory; give a Hugging Face model directory")
    cfg, hf = read_hf_config(src)
    sd = hf_to_fourd_state_dict(cfg, hf, read_hf_tensors(src))
    store.save_model_checkpoint(dst, cfg, sd, extra={"hf_config": hf})
    return cfg, sd


# ---- fourd -> Hugging Face -------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """config.json for `cfg`; `base` (the imported model's own config) keeps its other keys, e.g. token ids."""
    dtype_name = str(dtype).removeprefix("torch.")
    out = dict(base or {"bos_token_id": None, "eos_token_id": None})
    out.pop("rope_scaling", None)
    out.update(
        {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "hidden_size": cfg.dim,
            "intermediate_size": cfg.ffn,
            "num_hidden_layers": cfg.layers,
            "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab,
            "rms_norm_eps": cfg.norm_eps,
            "max_position_embeddings": cfg.max_seq,
            # Older readers take rope_theta at the top, newer ones from rope_parameters.
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
    )
    return out


def fourd_to_hf_tensors(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    shapes = _shapes(cfg)
    for name, shape in shapes.items():
        if name not in sd:
            raise FourdError(f"tensor {name} missing from the checkpoint (model config implies it)")
        if tuple(sd[name].shape) != shape:
            raise FourdError(f"tensor {name} has shape {list(sd[name].shape)}; the model config implies {list(shape)}")
    extra = sorted(set(sd) - set(shapes))
    if extra:
        raise FourdError(f"tensor {extra[0]} is not part of the model config's Llama")
    out = {}
    for name, hname in hf_names(cfg).items():
        w = sd[name]
        if name.endswith(("wq.weight", "wk.weight")):
            w = interleaved_to_halves(w, cfg.heads if name.endswith("wq.weight") else cfg.kv_heads)
        out[hname] = w.contiguous()
    return out


def _shard(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += n
    return shards


def write_hf(dst: Path, config: dict, tensors: dict[str, torch.Tensor], shard_bytes: int) -> None:
    """config.json and safetensors (sharded with an index past `shard_bytes`), renamed into place at the end."""
    from safetensors.torch import save_file

    if dst.exists():
        raise FourdError(f"{dst} already exists; remove it or choose another destination")
    tmp = store.staging_dir(dst)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        shards = _shard(tensors, shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, fname))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fourd_to_hf(src: str | os.PathLike, dst: str | os.PathLike, shard_bytes: int = 5_000_000_000) -> ModelConfig:
    cfg, sd = store.load_model_checkpoint(src)
    if cfg.mlp != "swiglu":
        raise FourdError(f"{src}: model.mlp = {cfg.mlp!r}; only Llama (swiglu) models export to Hugging Face")
    tensors = fourd_to_hf_tensors(cfg, sd)
    base = store.read_manifest(src).get("hf_config")
    write_hf(Path(dst), hf_config(cfg, sd["tok_embeddings.weight"].dtype, base), tensors, shard_bytes)
    return cfg
