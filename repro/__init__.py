"""Paper reproductions, one package per paper: each holds its analysis module (`repro.<paper>.analysis`) and
the scripts that reproduce the paper's figures, tables and timings. Run them from the repository root as
modules, e.g. `python -m repro.squat.figure2 --help`; they import the installed `kvzoo` package."""
