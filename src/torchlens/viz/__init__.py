"""(filled by a later issue)"""
