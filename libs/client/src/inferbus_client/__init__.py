"""Clients of inferbus's APIs, shared by the CLI, the tests and the services."""
