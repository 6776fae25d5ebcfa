"""Models in and out of shards: a pretrained model loaded into any strategy through the
`meta` device, and a sharded checkpoint exported as a Hugging Face folder. A file per
part:

    hf_files.py     config.json and model.safetensors: read into shards, checked, refused
    meta.py         build on meta, shard, materialize, restore buffers, load
    export.py       a shardlab checkpoint (any strategy, any world) as a Hugging Face folder
    host_memory.py  each rank's host memory for three ways of loading, beside the formula
"""

from shardlab.modelio.hf_files import (check_export_folder, check_matches, header_shapes, load_module,
                                       load_into, mismatches, read_model_config)
from shardlab.modelio.meta import (build_on_meta, parameters_on_meta, restore_buffers,
                                   wrap_on_meta)

__all__ = ["check_export_folder", "check_matches", "header_shapes", "load_into", "load_module",
           "mismatches", "read_model_config", "build_on_meta",
           "parameters_on_meta", "restore_buffers", "wrap_on_meta"]
