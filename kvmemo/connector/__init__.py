"""Moving full KV blocks between the device pool and stores that outlive the process.

Invariant: a block loaded from a store is validated before it is marked computed; a block is
saved only after the step that computed it committed it. base.py: the two-sided API;
store.py: BlockStore, namespace and file format; disk.py: DiskStore; spec.py: the kv_store option.
"""
