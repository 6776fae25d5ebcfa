from shardlab.diagrams.collectives import *  # noqa: F401,F403
