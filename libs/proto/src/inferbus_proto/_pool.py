"""The descriptor pool inferbus's generated messages live in (see isolate_pool.py)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
