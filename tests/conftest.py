import os

os.environ.setdefault("ONDECK_PROGRESS", "0")
