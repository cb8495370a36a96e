"""Integrations with other libraries, each imported on its own.

``ondeck.integrations.diffusers`` (also reachable as ``ondeck.diffusers``) loads any
diffusers pipeline with its heavy components on demand. Importing this package
imports none of them.
"""
