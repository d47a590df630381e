"""``python -m sp_plan.cli``: the same entry point as the ``sp-plan`` console script (torchrun launches it)."""

from sp_plan.cli.main import main

if __name__ == "__main__":
    main()
