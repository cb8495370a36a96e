"""``ondeck serve``: one resident process for many models, under one device budget.

``residency`` decides between the served pipelines, ``jobs`` queues their work,
``server`` holds both, and ``app`` (FastAPI, from the ``serve`` extra) puts OpenAI's
images and videos APIs in front. Importing this package imports no web framework.
"""
