"""The command line: `app` (the root command and the exit-code mapping), `options` (what commands
share) and one module per command."""
