"""Figures: one module per analysis (matplotlib). The plots never choose a backend: the
command line uses Agg (probekit.commands.main), notebooks keep their inline one."""
