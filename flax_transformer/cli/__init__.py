"""The command-line programs: train, decode, distill (`[project.scripts]` and the scripts at the
repository root call their `main`)."""
