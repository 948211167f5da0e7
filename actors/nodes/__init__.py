"""The engine in a cluster's processes: an engine node (`engine_node`) with its own HTTP port
(`engine_http`) and tensor-parallel ranks (`engine_ranks`), and a node of draft workers (`draft_node`).

Import the modules directly; this package imports nothing.
"""
