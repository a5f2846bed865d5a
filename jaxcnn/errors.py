"""The one exception type that means "the user gave us something we cannot use".

Scripts catch it at the top and print its message as a single line on stderr with a
non-zero exit and no traceback; anything else escaping is a bug in jaxcnn.
"""


class UserError(ValueError):
    """Bad input (flag, file, mesh, layout): the message says what is wrong and what to do."""
