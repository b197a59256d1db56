"""output: everything that owns an output folder.

    OUTPUT/results/            Delta Lake table: the current row per (source, page, task)
    OUTPUT/pages/              Delta Lake table: the current row per (source, page)
    OUTPUT/fields/<task>/      Delta Lake table per schema task: typed columns of current ok answers
    OUTPUT/_runs/<run_id>.json the run's manifest (and <run_id>.html, its report)
    OUTPUT/.lock               held while a run (or a compaction, a migration) writes

folder (paths, lock, manifest), schemas, table (the writer: one commit a flush), history
(what the current rows say is done), retire (rows of vanished files and pages), migrate
(the append-only parts of earlier versions -> tables), compact (optimize + vacuum), inspect.
"""
