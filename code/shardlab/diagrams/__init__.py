from shardlab.diagrams.collectives import *  # noqa: F401,F403
from shardlab.diagrams.layouts import *  # noqa: F401,F403
