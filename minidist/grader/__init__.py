"""The grader: one package, from the command a teacher types down to one check on one rank.

    command.py     `python -m minidist.grade`: finds the files and the checks, prints the
                   verdicts, writes --json; grades one student's file in this job.
    classroom.py   the teacher's form (`--ranks 3,4 FOLDER`): one fresh job per file and
                   rank count, so nothing one submission does reaches another's verdict.
    listing.py     what command.py and classroom.py share: the checks of each exercise file,
                   the rank counts each exercise grades at, how verdicts fold.
    referee.py     runs one check in a thread on every rank and agrees one verdict.
    counting.py    the communicator the checks hand to students: counts, refuses, stops.
    plugin.py      the plug-in check: the student's function in place of the package's
                   answer, the lesson's own equivalence run at a small shape.
    integrity.py   the grader's own code, snapshotted before a student's file runs and
                   compared after; the source scan that flags what a teacher should read.
    checks/        one module per exercise file: exNN_topic.py, its EXERCISES.

It imports downward only: the package's answers (minidist.ops, minidist.parallel, ...) and
the lessons' settings; nothing in the package or the lessons imports the grader.
"""
