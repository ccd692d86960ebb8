package sk.ainet.transformers.iree.android

import java.io.File
import java.io.RandomAccessFile
import java.nio.file.Files
import java.nio.file.Paths
import java.nio.file.StandardCopyOption
import java.util.Properties
import kotlin.system.exitProcess

/**
 * The JNI libraries on a real JVM: the ids of the Rust API (written by `jni-fixture`), every
 * failure mode as IllegalStateException with the session still working afterwards, and the
 * redecode loop. Run: `java -Djava.library.path=target/debug -cp ... JniTestKt fixture.properties`.
 */
class Fixture(path: String) {
    private val p = Properties().apply { File(path).inputStream().use { load(it) } }
    operator fun get(key: String): String = p.getProperty(key) ?: error("fixture has no `$key`")
    fun int(key: String) = get(key).toInt()
    fun ints(key: String): IntArray = get(key).split(',').filter { it.isNotEmpty() }.map { it.toInt() }.toIntArray()
    val spec = IreeKvSpec(
        int("spec.nLayers"), int("spec.headDim"), int("spec.nKvHeads"), int("spec.nHeads"),
        int("spec.hiddenSize"), int("spec.vocabSize"), int("spec.slidingWindow"),
        int("spec.globalLayerPeriod"), int("spec.chunk"), int("spec.maskHeads"),
        get("spec.slidingRopeBase").toFloat(), get("spec.globalRopeBase").toFloat(),
    )

    /** Opens the graphs whose keys start with [files] (`""`, `shared.`). */
    fun open(
        device: String = "local-task",
        withPrefill: Boolean = true,
        files: String = "",
        withPastVmfb: String = this["${files}withPast.vmfb"],
        withPastIrpa: String = this["${files}withPast.irpa"],
    ) = IreeKvSession.open(
        device, spec,
        withPastVmfb, withPastIrpa, this["${files}withPast.function"],
        this["${files}chunk.vmfb"], this["${files}chunk.irpa"], this["${files}chunk.function"],
        if (withPrefill) this["${files}prefill.vmfb"] else null,
        if (withPrefill) this["${files}prefill.irpa"] else null,
        if (withPrefill) this["${files}prefill.function"] else null,
    )
}

private var checks = 0
private val failures = ArrayList<String>()

private fun check(name: String, ok: Boolean, detail: () -> String = { "" }) {
    checks++
    if (!ok) failures.add("$name ${detail()}")
}

private fun same(name: String, got: IntArray?, want: IntArray) =
    check(name, got != null && got.contentEquals(want)) { "got ${got?.toList()}, want ${want.toList()}" }

/** Runs [block], which must throw IllegalStateException whose message contains [needle]. */
private fun throwsIse(name: String, needle: String = "", block: () -> Unit) {
    try {
        block()
        check(name, false) { "did not throw" }
    } catch (e: IllegalStateException) {
        check(name, e.message?.contains(needle) == true) { "message `${e.message}` lacks `$needle`" }
    } catch (e: Throwable) {
        check(name, false) { "threw ${e.javaClass.name}: ${e.message}" }
    }
}

fun main(args: Array<String>) {
    val f = Fixture(args.getOrNull(0) ?: error("usage: JniTest fixture.properties"))
    val seq = f.int("spec.seq")
    val prefix = f.ints("prefix")
    val maxNew = f.int("maxNew")
    val utterances = (0 until f.int("utterances")).map { f.ints("utterance.$it") to f.ints("expected.$it") }
    val eos = -1 // none: the Rust ids were generated without one

    val session = f.open()
    val decoder = IreeKvDecoder(session, seq)
    val prefixSnapshot = decoder.prefillPrefix(prefix)
    check("prefix position", session.position == f.int("prefix.position")) { "${session.position}" }
    check("snapshot position", prefixSnapshot.position == prefix.size)

    fun stillWorks(after: String) {
        val (utterance, expected) = utterances[0]
        val g = try {
            decoder.generate(prefixSnapshot, utterance, eos, maxNew).ids
        } catch (e: Throwable) {
            check("session works after $after", false) { "threw $e" }
            return
        }
        same("session works after $after", g, expected)
    }

    utterances.forEachIndexed { i, (utterance, expected) ->
        val g = decoder.generate(prefixSnapshot, utterance, eos, maxNew)
        same("generate utterance $i equals the Rust API", g.ids, expected)
    }
    stillWorks("a second round")

    // Raw calls: a prefill's first token; snapshot / step / restore round trip.
    val padded = IntArray(seq).also { prefix.copyInto(it) }
    check("prefill first token", session.prefill(padded, prefix.size) == f.int("prefix.firstToken"))
    val mid = session.snapshot()
    val a = session.step(7)
    session.step(8)
    session.restore(mid)
    check("restore rewinds", session.position == prefix.size && session.step(7) == a)
    mid.close()

    // Every failure mode: IllegalStateException, and the session still works afterwards.
    val vocab = f.spec.vocabSize
    val chunk = f.spec.chunk
    throwsIse("0 handle", "is 0") { IreeKvSession.nativeStep(0L, 1) }
    throwsIse("0 handle position", "is 0") { IreeKvSession.nativePosition(0L) }
    throwsIse("never issued handle", "kind `IreeKvSession`") { IreeKvSession.nativeStep(123456789L, 1) }
    val other = f.open()
    val otherHandle = other.javaClass.getDeclaredField("handle").apply { isAccessible = true }.getLong(other)
    other.prefill(padded, 4)
    val foreign = other.snapshot()
    throwsIse("foreign snapshot", "belongs to session") { session.restore(foreign) }
    stillWorks("a foreign snapshot")
    throwsIse("session handle as snapshot", "not `IreeKvSession snapshot`") {
        IreeKvSession.nativeRestore(otherHandle, otherHandle)
    }
    foreign.close()
    other.close()
    throwsIse("destroyed handle", "closed") { IreeKvSession.nativeStep(otherHandle, 1) }
    throwsIse("destroyed twice", "closed") { IreeKvSession.nativeDestroy(otherHandle) }
    stillWorks("a destroyed session")

    val released = session.snapshot()
    val releasedHandle = released.handle
    released.close()
    throwsIse("released snapshot", "closed") { IreeKvSession.nativeRestore(sessionHandle(session), releasedHandle) }
    throwsIse("snapshot released twice", "closed") { IreeKvSession.nativeReleaseSnapshot(releasedHandle) }
    throwsIse("snapshot handle as session", "not `IreeKvSession`") { IreeKvSession.nativeStep(prefixSnapshot.handle, 1) }
    stillWorks("a released snapshot")

    session.restore(prefixSnapshot)
    val before = session.position
    throwsIse("token id = vocab", "outside the vocabulary") { session.step(vocab) }
    throwsIse("negative token id", "outside the vocabulary") { session.chunk(intArrayOf(1, -1), 2) }
    throwsIse("chunk of 0", "expected 1..=$chunk") { session.chunk(IntArray(chunk), 0) }
    throwsIse("chunk > C", "expected 1..=$chunk") { session.chunk(IntArray(chunk + 1), chunk + 1) }
    throwsIse("n > array length", "outside 0..=2") { session.chunk(intArrayOf(1, 2), 3) }
    throwsIse("negative n", "outside") { session.prefill(padded, -1) }
    throwsIse("prefill longer than SEQ", "expected 1..=$seq") { session.prefill(IntArray(seq + 1), seq + 1) }
    check("failed calls leave the position", session.position == before)
    stillWorks("bad tokens and counts")

    throwsIse("wrong device name", "unknown device `tpu`") { f.open(device = "tpu") }
    throwsIse("missing vmfb", "/no/such.vmfb") { f.open(withPastVmfb = "/no/such.vmfb") }
    stillWorks("failed opens")

    // Without a prefill module: prefill is refused, the rest opens.
    f.open(withPrefill = false).use { noPrefill ->
        throwsIse("prefill without a prefill module", "without a prefill module") { noPrefill.prefill(padded, 3) }
    }

    // releasePrefill: the prefix snapshot keeps serving utterances; prefill is gone.
    session.releasePrefill()
    stillWorks("releasePrefill")
    throwsIse("prefill after releasePrefill", "released") { session.prefill(padded, 3) }
    utterances.forEachIndexed { i, (utterance, expected) ->
        same("utterance $i after releasePrefill", decoder.generate(prefixSnapshot, utterance, eos, maxNew).ids, expected)
    }
    prefixSnapshot.close()
    session.close()
    throwsIse("closed Kotlin session", "closed") { session.step(1) }

    sharedModuleReleasePrefill(f)
    vulkanThreeArchives(f)
    contractV2(f)
    snapshotFiles(f)
    embeddingTableOfSeedArtifacts(f)
    changedArchives(f)
    redecode(f)

    println("JniTest: $checks checks, ${failures.size} failed")
    failures.forEach { println("FAILED: $it") }
    exitProcess(if (failures.isEmpty()) 0 else 1)
}

/** One module for all three graphs: `releasePrefill` disables prefill there too. */
private fun sharedModuleReleasePrefill(f: Fixture) {
    val prefix = f.ints("prefix")
    val padded = IntArray(f.int("spec.seq")).also { prefix.copyInto(it) }
    f.open(files = "shared.").use { s ->
        s.prefill(padded, prefix.size)
        val snapshot = s.snapshot()
        val next = s.step(7)
        s.releasePrefill()
        throwsIse("shared module: prefill after releasePrefill", "was released") { s.prefill(padded, prefix.size) }
        s.releasePrefill()
        s.restore(snapshot)
        check("shared module: restore and step after releasePrefill", s.step(7) == next)
        snapshot.close()
    }
}

/**
 * The seed's three-archive layout on `vulkan` (lavapipe here): three modules on one device open,
 * reproduce the Rust API's ids there, and keep serving utterances once the prefill is released.
 */
private fun vulkanThreeArchives(f: Fixture) {
    val seq = f.int("spec.seq")
    val maxNew = f.int("maxNew")
    f.open(device = "vulkan", files = "vulkan.").use { s ->
        val decoder = IreeKvDecoder(s, seq)
        decoder.prefillPrefix(f.ints("prefix")).use { prefix ->
            for (round in listOf("", " after releasePrefill")) {
                for (i in 0 until f.int("utterances")) {
                    val g = decoder.generate(prefix, f.ints("utterance.$i"), -1, maxNew)
                    same("vulkan three archives: utterance $i$round", g.ids, f.ints("vulkan.expected.$i"))
                }
                s.releasePrefill()
            }
        }
    }
}

/**
 * Contract v2 files behind the unchanged ABI (the library reads the contract from the step
 * function): opened without a prefill module, they reproduce the Rust API's ids on them, a prefill
 * runs as chunk calls, and a prefill module passed with them is refused.
 */
private fun contractV2(f: Fixture) {
    val seq = f.int("spec.seq")
    val maxNew = f.int("maxNew")
    val prefix = f.ints("prefix")
    f.open(files = "v2.", withPrefill = false).use { s ->
        val decoder = IreeKvDecoder(s, seq)
        decoder.prefillPrefix(prefix).use { snapshot ->
            check("v2: prefix position", s.position == prefix.size) { "${s.position}" }
            for (i in 0 until f.int("utterances")) {
                val g = decoder.generate(snapshot, f.ints("utterance.$i"), -1, maxNew)
                same("v2: utterance $i equals the Rust API", g.ids, f.ints("v2.expected.$i"))
            }
            s.restore(snapshot)
            val next = s.step(7)
            s.restore(snapshot)
            check("v2: restore rewinds", s.position == prefix.size && s.step(7) == next)
            s.releasePrefill()
            throwsIse("v2: prefill after releasePrefill", "released") {
                s.prefill(IntArray(seq).also { prefix.copyInto(it) }, prefix.size)
            }
        }
    }
    throwsIse("v2 files with a prefill module", "no prefill graph") {
        IreeKvSession.open(
            "local-task", f.spec,
            f["v2.withPast.vmfb"], f["v2.withPast.irpa"], f["v2.withPast.function"],
            f["v2.chunk.vmfb"], f["v2.chunk.irpa"], f["v2.chunk.function"],
            f["v2.chunk.vmfb"], f["v2.chunk.irpa"], f["v2.chunk.function"],
        ).close()
    }
}

/**
 * Snapshot files: a prefix saved from one session loads into a fresh one (of another layout too)
 * and continues with the Rust API's ids; bad files and closed handles throw and change nothing.
 */
private fun snapshotFiles(f: Fixture) {
    val seq = f.int("spec.seq")
    val maxNew = f.int("maxNew")
    val prefix = f.ints("prefix")
    val dir = Files.createTempDirectory("skainet-snapshots")
    val path = dir.resolve("prefix.skvsnap").toString()
    f.open().use { s ->
        IreeKvDecoder(s, seq).prefillPrefix(prefix).use { snapshot ->
            val bytes = IreeKvSnapshotFile.save(s, snapshot, path)
            check("snapshot file size", bytes == File(path).length() && bytes > 0) { "$bytes" }
        }
    }
    for (files in listOf("", "shared.")) {
        f.open(files = files).use { s ->
            val decoder = IreeKvDecoder(s, seq)
            val loaded = IreeKvSnapshotFile.load(s, path)
            check("loaded snapshot position ($files)", loaded.position == prefix.size && s.position == 0) {
                "${loaded.position} / ${s.position}"
            }
            for (i in 0 until f.int("utterances")) {
                val g = decoder.generate(loaded, f.ints("utterance.$i"), -1, maxNew)
                same("utterance $i after a loaded file ($files)", g.ids, f.ints("expected.$i"))
            }
            loaded.close()
        }
    }
    f.open().use { s ->
        val decoder = IreeKvDecoder(s, seq)
        val own = decoder.prefillPrefix(prefix.copyOfRange(0, 5))
        val truncated = dir.resolve("truncated.skvsnap")
        Files.write(truncated, Files.readAllBytes(Paths.get(path)).copyOfRange(0, 100))
        throwsIse("truncated snapshot file", "truncated") { IreeKvSnapshotFile.load(s, truncated.toString()) }
        throwsIse("missing snapshot file", "no-such") { IreeKvSnapshotFile.load(s, dir.resolve("no-such").toString()) }
        throwsIse("snapshot file to a missing directory", "missing-dir") {
            IreeKvSnapshotFile.save(s, own, dir.resolve("missing-dir/x").toString())
        }
        check("failed loads leave the session", s.position == 5) { "${s.position}" }
        val (utterance, expected) = f.ints("utterance.0") to f.ints("expected.0")
        same("session works after bad files", decoder.generate(IreeKvSnapshotFile.load(s, path), utterance, -1, maxNew).ids, expected)
        throwsIse("load with a 0 handle", "is 0") { IreeKvSnapshotFile.nativeLoad(0L, path) }
        throwsIse("save of a 0 snapshot", "is 0") { IreeKvSnapshotFile.nativeSave(sessionHandle(s), 0L, path) }
        own.close()
        throwsIse("save of a closed snapshot", "closed") { IreeKvSnapshotFile.save(s, own, path) }
    }
    dir.toFile().deleteRecursively()
}

/**
 * With-past archives holding a second entry of the embedding's size (an untied model's output
 * table would be one): a manifest.json beside the vmfb names the table, else a well-known name;
 * without either the error says what to write where.
 */
private fun embeddingTableOfSeedArtifacts(f: Fixture) {
    val prefix = f.ints("prefix")
    val padded = IntArray(f.int("spec.seq")).also { prefix.copyInto(it) }
    fun open(case: String) = f.open(withPastVmfb = f["embeddings.$case.vmfb"], withPastIrpa = f["embeddings.$case.irpa"])
    for ((case, how) in listOf("named" to "by the manifest.json beside the vmfb", "well-known" to "by its well-known name")) {
        val name = "two tables of one size: found $how"
        try {
            open(case).use { s -> check(name, s.prefill(padded, prefix.size) == f.int("prefix.firstToken")) }
        } catch (e: IllegalStateException) {
            check(name, false) { "threw ${e.message}" }
        }
    }
    val bare = f["embeddings.bare.vmfb"]
    val manifest = File(File(bare).parentFile, "manifest.json").path
    throwsIse("two tables of one size, no hint: the error says what to write where", "into $manifest (a manifest.json beside $bare)") {
        open("bare")
    }
}

/** Archives truncated or replaced after `nativeCreate`: the next call throws, no SIGBUS. */
private fun changedArchives(f: Fixture) {
    val prefix = f.ints("prefix")
    val padded = IntArray(f.int("spec.seq")).also { prefix.copyInto(it) }
    val dir = Files.createTempDirectory("skainet-jni-changed")
    fun copy(key: String): String {
        val from = Paths.get(f[key])
        return Files.copy(from, dir.resolve(from.fileName), StandardCopyOption.REPLACE_EXISTING).toString()
    }
    fun open(): IreeKvSession {
        val irpa = copy("withPast.irpa")
        return f.open(withPastVmfb = copy("withPast.vmfb"), withPastIrpa = irpa)
    }
    val irpa = dir.resolve(Paths.get(f["withPast.irpa"]).fileName)

    open().use { s ->
        s.prefill(padded, prefix.size)
        RandomAccessFile(irpa.toFile(), "rw").use { it.setLength(it.length() / 4) }
        throwsIse("truncated archive: step throws", "changed since it was opened") { s.step(7) }
        throwsIse("truncated archive: chunk throws", "changed since it was opened") { s.chunk(intArrayOf(1, 2), 2) }
    }
    open().use { s ->
        s.prefill(padded, prefix.size)
        val fresh = dir.resolve("fresh.irpa")
        Files.copy(Paths.get(f["withPast.irpa"]), fresh)
        Files.move(fresh, irpa, StandardCopyOption.REPLACE_EXISTING, StandardCopyOption.ATOMIC_MOVE)
        throwsIse("replaced archive: step throws", "replaced") { s.step(7) }
    }
    dir.toFile().deleteRecursively()
}

private fun sessionHandle(s: IreeKvSession): Long =
    s.javaClass.getDeclaredField("handle").apply { isAccessible = true }.getLong(s)

private fun redecode(f: Fixture) {
    val seq = f.int("redecode.seq")
    val prompt = f.ints("redecode.prompt")
    val expected = f.ints("redecode.expected")
    val maxNew = f.int("maxNew")
    val vmfb = f["redecode.vmfb"]
    val irpa = f["redecode.irpa"]
    val fn = f["redecode.function"]
    IreeRedecodeSession("local-task", vmfb, irpa, fn, seq).use { s ->
        same("redecode loop equals the Rust API", s.generate(prompt, -1, maxNew), expected)
        throwsIse("redecode tokenIds.length != SEQ", "expected $seq..=$seq") { s.step(IntArray(seq - 1)) }
        same("redecode works after a bad call", s.generate(prompt, -1, maxNew), expected)
    }
    IreeRedecodeSession("local-task", vmfb, irpa, fn, seq, 2).use { s ->
        same("redecode with topology (2 workers)", s.generate(prompt, -1, maxNew), expected)
    }
    IreeRedecodeSession("local-task", f["redecode.mismatch.vmfb"], irpa, f["redecode.mismatch.function"], seq).use { s ->
        check("contract mismatch returns null", s.step(IntArray(seq)) == null)
    }
    throwsIse("redecode 0 handle", "is 0") { IreeRedecodeSession.nativeStep(0L, IntArray(seq)) }
    throwsIse("redecode wrong device", "unknown device") { IreeRedecodeSession("gpu0", vmfb, irpa, fn, seq) }
    throwsIse("redecode missing vmfb", "/no/such.vmfb") { IreeRedecodeSession("local-task", "/no/such.vmfb", irpa, fn, seq) }
    throwsIse("redecode missing function", "module.nope") { IreeRedecodeSession("local-task", vmfb, irpa, "module.nope", seq) }
    throwsIse("redecode 0 groups", "at least one worker") { IreeRedecodeSession("local-task", vmfb, irpa, fn, seq, 0) }
    val h = IreeRedecodeSession.nativeCreate("local-task", vmfb, irpa, fn)
    IreeRedecodeSession.nativeDestroy(h)
    throwsIse("redecode destroyed handle", "closed") { IreeRedecodeSession.nativeStep(h, IntArray(seq)) }
    throwsIse("redecode destroyed twice", "closed") { IreeRedecodeSession.nativeDestroy(h) }
}
