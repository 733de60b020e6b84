/*
 * tests/fuzz/replay.c — runs a fuzz target without libFuzzer: LLVMFuzzerInitialize (when the
 * target has one), then LLVMFuzzerTestOneInput once on every regular file of each directory (or
 * file) given, in name order. Linked with each tests/fuzz/fuzz-<name>.c in the normal build, it
 * replays tests/fuzz/corpus/fuzz-<name> as ctest fuzz-<name>, under the sanitizers in the
 * sanitizer build. Exit status 0 when every input ran (a target aborts on a bug), 1 when an input
 * could not be read or none was found.
 */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv);

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return -1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *data = malloc(cap);
    size_t got;
    while (data != NULL && (got = fread(data + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            uint8_t *bigger = realloc(data, cap *= 2);
            if (bigger == NULL)
                free(data);
            data = bigger;
        }
    }
    int err = ferror(f);
    fclose(f);
    if (data == NULL || err) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(data);
        return -1;
    }
    /* Exactly n bytes, as libFuzzer hands them: a copy of its own so that reads past the end
     * are caught under AddressSanitizer. */
    uint8_t *input = malloc(n > 0 ? n : 1);
    if (input == NULL) {
        free(data);
        return -1;
    }
    memcpy(input, data, n);
    free(data);
    LLVMFuzzerTestOneInput(input, n);
    free(input);
    return 0;
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    if (LLVMFuzzerInitialize != NULL)
        LLVMFuzzerInitialize(&argc, &argv);
    int ran = 0, failed = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "replay: no %s\n", argv[i]);
            failed++;
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            failed += run_file(argv[i]) != 0;
            ran++;
            continue;
        }
        struct dirent **names = NULL;
        int n = scandir(argv[i], &names, NULL, NULL);
        if (n < 0) {
            fprintf(stderr, "replay: cannot list %s\n", argv[i]);
            failed++;
            continue;
        }
        char **paths = calloc((size_t)n + 1, sizeof(*paths));
        int k = 0;
        for (int j = 0; j < n; j++) {
            char path[4096];
            snprintf(path, sizeof(path), "%s/%s", argv[i], names[j]->d_name);
            if (paths != NULL && stat(path, &st) == 0 && S_ISREG(st.st_mode))
                paths[k++] = strdup(path);
            free(names[j]);
        }
        free(names);
        if (paths == NULL) {
            failed++;
            continue;
        }
        qsort(paths, (size_t)k, sizeof(*paths), by_name);
        for (int j = 0; j < k; j++) {
            if (paths[j] == NULL || run_file(paths[j]) != 0)
                failed++;
            else
                ran++;
            free(paths[j]);
        }
        free(paths);
    }
    printf("replay: %d inputs, %d failed\n", ran, failed);
    return failed > 0 || ran == 0 ? 1 : 0;
}
