"""Admission data kept in Redis, shared by the gateway (which enforces it) and the
CLI (which edits it): key names (`keys`), QPS limits (`limits`), API keys and
access lists (`apikeys`).
"""
