"""Pipeline schedules as plain data: per-rank action lists, their generators, and a checker."""
