"""Hugging Face model directories: read, run and write them (model_dir.py), the tensor names per
family (mapping.py), config.json's keys (config_json.py) and safetensors files (tensorfile.py)."""

from jaxtron.hf.model_dir import (  # noqa: F401 - the names callers take from the package
    ARCHITECTURES,
    GENERATION,
    INDEX,
    Getter,
    check_tensors,
    eos_ids,
    from_pretrained,
    logits,
    model_type_of,
    read_config,
    read_hf_config,
    read_tensors,
    save_pretrained,
    write_generation_config,
    write_pretrained,
)
