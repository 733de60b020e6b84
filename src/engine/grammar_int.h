/*
 * engine/grammar_int.h — what the tests reach inside engine/grammar.c.
 */
#ifndef LLMEM_ENGINE_GRAMMAR_INT_H
#define LLMEM_ENGINE_GRAMMAR_INT_H

struct llmem_grammar_vocab;

/* Marks v's trie as holding no subtree of plain bytes alone (struct tnode.plain), so that every
 * walk over it visits each node: the masks it gives must be the same. */
void llmem_grammar_vocab_no_plain(struct llmem_grammar_vocab *v);

#endif
