"""The names the registries accept, in a module light enough for the command line's choices
(the registries themselves import torch); each registry is built over these names."""

DTYPES = {  # a dtype a user may pass -> its torch name
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}
QUANTIZATIONS = ("nvfp4", "mxfp4")  # block-scaled FP4 weight formats (quant/formats.py)
# KV cache storage (models/kv_store.py)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "fp8", "fp4")
