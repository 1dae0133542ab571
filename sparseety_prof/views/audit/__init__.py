"""`audit DIR [--train DIR...]`: how well a recording's sparse decisions recover its tokens."""
