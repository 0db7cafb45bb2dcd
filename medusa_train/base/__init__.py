"""What every room uses: the error types (a bad input is one line and exit code 2) and the file writes that a crash
never leaves half done."""
