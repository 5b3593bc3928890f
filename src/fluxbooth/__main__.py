from fluxbooth.cli import main

if __name__ == "__main__":  # importing the package's modules (a walk over them) must not run the CLI
    raise SystemExit(main())
