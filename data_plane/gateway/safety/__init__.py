"""The gateway's safety filters: ``pipeline`` (the input and output policy the chat handler applies),
``filters`` (the matchers) and ``stream`` (the output filter that holds back only what could still
become a blocked match).
"""
