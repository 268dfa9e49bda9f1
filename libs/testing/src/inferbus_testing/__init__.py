"""Test infrastructure for inferbus.

Real servers for tests (`servers`), service processes (`processes`) and the
pytest plugin with the shared fixtures (`fixtures`, loaded by the root
``conftest.py``).
"""
