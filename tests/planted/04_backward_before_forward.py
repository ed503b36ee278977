"""GPipe with the backwards of the last stage listed first (reading 'the last stage starts
the backward' as 'the last stage runs B first')."""


def gpipe(p, m):
    out = [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)] for _ in range(p - 1)]
    out.append([("B", i, 0) for i in range(m)] + [("F", i, 0) for i in range(m)])
    return out
