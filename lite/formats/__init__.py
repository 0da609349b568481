"""The single source of truth for checkpoint formats: on-disk layouts (weights and calibrated KV-cache
parameters), config fields, model folders (``liteturbo_home``, the cache folder, is :mod:`backends.platform`'s)."""
from backends.platform import liteturbo_home

from .arch import ARCHITECTURES, DECODER_LINEARS, ArchSpec, arch_spec
from .awq import awq_quantization_config, pack_awq, unpack_awq
from .checkpoint import (LazyStateDict, check_checkpoint_dir, copy_tokenizer_files, load_config, load_state_dict,
                         resolve_model)
from .errors import LiteturboError
from .kv import KV_CONFIG_FIELD, KV_PARAMS_FILE, kv_config_block, load_kv_params, save_kv_params
from .quantized import load_quantized_linears, quantization_spec, quantized_prefixes
from .writing import atomic_output_dir, check_output_dir, check_writable_parent, make_dirs, write_json

__all__ = [
    "ARCHITECTURES", "DECODER_LINEARS", "ArchSpec", "arch_spec", "awq_quantization_config", "pack_awq",
    "unpack_awq", "LazyStateDict", "atomic_output_dir", "check_checkpoint_dir", "check_output_dir", "check_writable_parent",
    "make_dirs",
    "copy_tokenizer_files", "liteturbo_home", "load_config", "load_state_dict", "resolve_model", "write_json", "LiteturboError",
    "load_quantized_linears", "quantization_spec", "quantized_prefixes", "KV_CONFIG_FIELD", "KV_PARAMS_FILE",
    "kv_config_block", "load_kv_params", "save_kv_params",
]
