"""`python -m minidist.grade`: the grader's command. It lives in minidist/grader/command.py;
this name stays because it is the one students and teachers type."""
from minidist.failfast import agreed_exit
from minidist.grader.command import main

if __name__ == "__main__":
    agreed_exit(main())  # the verdicts and usage errors are agreed: every rank exits alike
