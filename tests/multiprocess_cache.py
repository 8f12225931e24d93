"""Test runners only: let every process of a CPU multi-process run read the persistent compilation cache.

jax writes cache entries from process 0 only, and on CPU its cache key includes the device assignment and the
process's own view of the topology, so process 1 never finds what process 0 wrote and compiles every program
again (about 30 s per two-process test here). jax already strips the device assignment from the key on GPU
(`jax._src.cache_key`: "invariant between processes"); the runners do the same on CPU. If jax renames these
internals the runners only get slower: nothing they check depends on it.
"""


def share_compilation_cache() -> bool:
    try:
        from jax._src import cache_key
        hash_options = cache_key._hash_serialized_compile_options
        hash_devices = cache_key._hash_devices
    except (ImportError, AttributeError):
        return False

    def options_without_assignment(hash_obj, compile_options, strip_device_assignment=False):
        return hash_options(hash_obj, compile_options, strip_device_assignment=True)

    cache_key._hash_serialized_compile_options = options_without_assignment
    cache_key._hash_accelerator_config = hash_devices  # the device kinds, one per device
    return True
