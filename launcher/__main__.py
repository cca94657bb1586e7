from launcher.cli import main

if __name__ == "__main__":  # not when a spawned worker re-imports the main module
    main()
